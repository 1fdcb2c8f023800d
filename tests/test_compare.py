"""experiments/compare_finetune_vs_scratch.py at tiny size: every run is reported, all with the same seed and budget."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_hf.assets import chitchat_conversations
from eagle3_hf.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]


def test_report_lists_every_run_with_same_seed_and_budget(tmp_path, tiny_verifier_dir, monkeypatch):
    monkeypatch.setenv("EAGLE3_HF_CACHE", str(tmp_path / "cache"))  # the drifted tiny verifier goes here
    from experiments.compare_finetune_vs_scratch import main as compare

    convs = tmp_path / "convs.jsonl"
    rows = [c for _, c in zip(range(16), chitchat_conversations())]
    convs.write_text("".join(json.dumps(c) + "\n" for c in rows))
    verifier = str(tiny_verifier_dir)
    assert cli(["prepare", "--tokenizer", verifier, "--input", str(convs), "--output", str(tmp_path / "prep"),
                "--max-seq-len", "64"]) == 0
    assert cli(["extract", "--verifier", verifier, "--data", str(tmp_path / "prep"), "--output",
                str(tmp_path / "feats"), "--dtype", "fp32", "--no-progress"]) == 0
    assert cli(["vocab", "--data", str(tmp_path / "prep"), "--draft-vocab-size", "256", "--output",
                str(tmp_path / "feats" / "vocab.safetensors")]) == 0

    out = tmp_path / "cmp"
    results = compare(["--data-dir", str(tmp_path / "feats"), "--prepared-dir", str(tmp_path / "prep"),
                       "--build-sources", "--drift-steps", "1", "--drift-held-out", "2", "--other-layers", "1,3,4",
                       "--verifier", verifier, "--output-dir", str(out), "--epochs", "1", "--source-epochs", "1",
                       "--max-seq-len", "64", "--validation-fraction", "0.25", "--eval-steps", "2",
                       "--eval-prompts", "1", "--eval-tokens", "4", "--seed", "3"])
    runs = ["scratch", "finetune:matching", "finetune:other-layers", "finetune:drift-s1"]
    assert list(results) == runs
    assert json.loads((out / "report.json").read_text()) == results
    budgets = [r["budget"] for r in results.values()]
    assert all(b == budgets[0] for b in budgets) and budgets[0]["seed"] == 3 and budgets[0]["optimizer_steps"] > 0
    report = (out / "report.md").read_text()
    for run in runs:
        line = next(ln for ln in report.splitlines() if ln.startswith(f"| {run} |"))
        assert line.endswith(f"| 3 / 1 / {budgets[0]['optimizer_steps']} |")
    drift = results["finetune:drift-s1"]["verifier_drift"]
    assert 0 <= drift["greedy_agreement"] <= 1 and drift["kl"] > 0
    for run in runs[1:]:
        assert results[run]["source_before"]["source_acc_0"] is not None
        assert results[run]["advice"].startswith(("at or above", "below"))  # what --finetune-from logged
        assert results[run]["tau"]["lossless"] is True
    assert (out / "curves.png").stat().st_size and (out / "tau_vs_drift.png").stat().st_size


def test_finetune_advice_states_the_measured_bound():
    from eagle3_hf.training import SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH as bound
    from eagle3_hf.training import finetune_advice

    assert f"{bound:.2f}" in (ROOT / "docs" / "finetune_vs_scratch.md").read_text()
    assert finetune_advice(bound + 0.05).startswith(f"at or above {bound:.2f}: every source")
    assert finetune_advice(bound - 0.05).startswith(f"below {bound:.2f}")
    assert finetune_advice(float("nan")).startswith("no validation data")
