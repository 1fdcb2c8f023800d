"""The demo's table in README.md is the one docs/results/demo.md holds, and both are what
examples/demo_summary.py writes: nobody edits the table by hand."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def demo_summary():
    spec = importlib.util.spec_from_file_location("demo_summary", ROOT / "examples" / "demo_summary.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["demo_summary"] = module
    spec.loader.exec_module(module)
    return module


def between_markers(text: str) -> str:
    ds = demo_summary()
    return text[text.index(ds.BEGIN) + len(ds.BEGIN):text.index(ds.END)].strip()


def test_readme_embeds_the_committed_demo_table():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    page = (ROOT / "docs" / "results" / "demo.md").read_text(encoding="utf-8")
    assert between_markers(readme) == between_markers(page)
    assert "docs/results/demo.md" in readme


def test_results_writes_the_page_and_the_readme_copy(tmp_path, monkeypatch):
    ds = demo_summary()
    table = "| what | value |\n|---|---|\n| simulated τ | 1.234 |"
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{ds.BEGIN}\nold\n{ds.END}\n\nafter\n")
    ds.embed(readme, table)
    assert readme.read_text() == f"intro\n\n{ds.BEGIN}\n{table}\n{ds.END}\n\nafter\n"
    page = ds.results_page(table, "small")
    assert between_markers(page) == table and "- command: `make demo`" in page and "- commit: " in page


def test_a_finished_demo_is_one_command_from_the_committed_table(tmp_path, monkeypatch):
    """summarize -> as_markdown on a demo directory's artifacts, the wall time kept from an earlier summary."""
    ds = demo_summary()
    out = tmp_path / "small"
    (out / "features").mkdir(parents=True)
    (out / "drafter").mkdir()
    (out / "eval").mkdir()
    (out / "export").mkdir()
    (out / "features" / "manifest.json").write_text(json.dumps(
        {"samples": [{"length": 100}, {"length": 20}], "verifier": {"hidden_size": 8}}))
    (out / "features" / "shard-00000.safetensors").write_bytes(b"x" * 1000)
    (out / "drafter" / "eagle3_training.json").write_text(json.dumps(
        {"data": {"num_samples": 1, "num_tokens": 100},
         "metrics": {"step_accuracy": [0.5, 0.4], "step_conditional_accuracy": [0.5, 0.8],
                     "simulated_acceptance_length": 1.9}}))
    (out / "eval" / "eagle3_evaluation.json").write_text(json.dumps(
        {"acceptance_length": 1.5, "per_position_acceptance": [0.4, 0.1], "speedup": 1.1, "lossless": True,
         "engine": "transformers", "k": 2, "temperature": 0.0, "prompts": "mt-bench", "num_prompts": 2}))
    (out / "timings.txt").write_text("regenerate 5\ntrain 7\n")
    (out / "summary.json").write_text(json.dumps({"total_seconds": 42}))
    readme, page = tmp_path / "README.md", tmp_path / "demo.md"
    readme.write_text(f"{ds.BEGIN}\n{ds.END}\n")
    monkeypatch.setattr(ds, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["demo_summary.py", str(out), "--results", str(page)])
    ds.main()
    table = between_markers(page.read_text())
    assert table == between_markers(readme.read_text()) == (out / "summary.md").read_text().strip()
    assert "| total wall time" in table and "42 s" in table and "1.500" in table
