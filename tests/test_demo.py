"""`make demo` end to end at a tiny size: every stage through the real CLI, then its artifacts checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from eagle3_hf.demo_data.overlap import find_overlaps
from eagle3_hf.demo_data.prompts import mtbench_questions

from tests.helpers.drafters import STANDARD_KEYS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(1500)  # the tiny demo, run once for the module: 465 s measured (README, Development)


@pytest.mark.slow
def test_demo_pipeline_tiny(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, DEMO_SIZE="tiny", DEMO_OUT=str(out),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("HF_REPO_ID", None)
    result = subprocess.run(["bash", "examples/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    regenerated = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert len(regenerated) == 12 and all(r["messages"][-1]["role"] == "assistant" for r in regenerated)
    # what the demo trained on shares no text with the questions it is evaluated on (all 80, both turns):
    # not equal after normalising, no shared 8-word run (eagle3_hf/demo_data/overlap.py)
    assert find_overlaps(regenerated, mtbench_questions()) == []
    manifest = json.loads((out / "features" / "manifest.json").read_text())
    assert len(manifest["samples"]) == 12 and manifest["aux_layer_indices"] == [2, 15, 27]
    with safe_open(str(out / "export" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == STANDARD_KEYS
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    rows = (out / "eval" / "acceptance.csv").read_text().splitlines()
    assert len(rows) == 1 + 2  # header + 2 MT-bench questions
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lossless"] is True
    assert 1.0 <= summary["acceptance_length"] <= 4.0 and len(summary["step_accuracy"]) == 3
    assert summary["bytes_per_token"] > 0 and summary["tokens"] == sum(s["length"] for s in manifest["samples"])
    assert "| τ (real speculative decoding)" in (out / "summary.md").read_text()
    # the tree stage: a sweep on development prompts, then its fastest tree on the chain's questions, lossless
    sweep = json.loads((out / "sweep" / "eagle3_sweep.json").read_text())
    assert sweep["prompts"] == "dev" and {c["topk"] for c in sweep["configs"]} == {1, 4}
    assert summary["tree"]["topk"] == 4 and summary["tree"]["lossless"] is True
    assert json.loads((out / "export" / "eagle3_sweep.json").read_text()) == sweep  # the model card reads it
    if summary["vllm"] is not None:  # `make test` installs vLLM: the demo then serves the export in it
        assert summary["vllm"]["lossless"] is True and summary["vllm"]["acceptance_length"] >= 1.0
