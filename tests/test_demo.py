"""`make demo` end to end at a tiny size: every stage through the real CLI, then its artifacts checked.

The tiny demo's drafter learns nothing (6 training samples, one epoch: τ 1.0, step accuracy 0), so nothing here
is a claim about acceptance; what τ means and how it is counted is tested in tests/decoding and tests/evaluation.
These tests check that the stages hand each other the right things and that what a user would publish (the
export and its model card) says what the stages measured. The demo runs once for the module."""

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
from eagle3_hf.evaluation.recommend import recommend
from eagle3_hf.publish.model_card import build_model_card

from tests.helpers.drafters import STANDARD_KEYS
from tests.helpers.vllm import skipping_vllm, vllm_or_fail

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(1500)  # the tiny demo, run once for the module: 465 s measured (docs/development.md)
EVAL_QUESTIONS, EVAL_TOKENS = 2, 12  # examples/demo.sh, DEMO_SIZE=tiny
SMOLLM2_HIDDEN = 576


@pytest.fixture(scope="module")
def vllm():
    vllm_or_fail()


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "demo"
    env = dict(os.environ, DEMO_SIZE="tiny", DEMO_OUT=str(out),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("HF_REPO_ID", None)
    if skipping_vllm():
        env["DEMO_VLLM"] = "0"
    result = subprocess.run(["bash", "examples/demo.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def check_pipeline(out: Path) -> None:
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
    assert len(rows) == 1 + EVAL_QUESTIONS  # header + the MT-bench questions
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lossless"] is True and len(summary["step_accuracy"]) == 3
    assert summary["tokens"] == sum(s["length"] for s in manifest["samples"])
    # bf16 features: 3 aux states + the final one, 2 bytes per value, plus a few bytes of ids, mask and greedy token
    reference = 4 * SMOLLM2_HIDDEN * 2
    assert summary["reference_bytes_per_token"] == reference
    assert reference < summary["bytes_per_token"] < reference + 32, summary["bytes_per_token"]
    assert "| τ (real speculative decoding)" in (out / "summary.md").read_text()

    # the tree stage: a sweep on development prompts, then its fastest tree on the chain's questions, lossless
    sweep = json.loads((out / "sweep" / "eagle3_sweep.json").read_text())
    assert sweep["prompts"] == "dev" and {c["topk"] for c in sweep["configs"]} == {1, 4}
    trees = [c for c in sweep["configs"] if c["topk"] > 1]
    first = recommend(trees)  # the recommendation's rule, restricted to trees: what the demo decodes
    tree = summary["tree"]
    assert (tree["steps"], tree["topk"], tree["num_draft_tokens"]) == (
        first.steps, first.topk, first.num_draft_tokens), (tree, trees)
    assert summary["tree"]["recommendation"] == sweep["recommendation"]  # one answer, printed everywhere
    assert tree["lossless"] is True
    chain = json.loads((out / "eval" / "eagle3_evaluation.json").read_text())
    ran_tree = json.loads((out / "eval_tree" / "eagle3_evaluation.json").read_text())
    assert (ran_tree["prompts"], ran_tree["num_prompts"], ran_tree["max_new_tokens"]) == (
        chain["prompts"], chain["num_prompts"], chain["max_new_tokens"]) == ("mt-bench", EVAL_QUESTIONS, EVAL_TOKENS)

    # the model card the export would be pushed with states what the stages measured
    card = str(build_model_card(out / "export"))
    assert f"Mean acceptance length τ = **{chain['acceptance_length']:.2f}**" in card
    assert f"prompts: mt-bench ({EVAL_QUESTIONS} prompts)" in card
    assert "## Serving configuration (sweep)" in card and f"```\n{sweep['sglang_flags']}\n```" in card


def check_vllm(out: Path) -> None:
    """The demo's vLLM stage served the export, on the chain's questions, token-identical to plain vLLM, and the
    export's model card reports it."""
    path = out / "eval_vllm" / "eagle3_evaluation_vllm.json"
    assert path.is_file(), "vLLM is installed but the demo skipped its vLLM stage"
    served = json.loads(path.read_text())
    chain = json.loads((out / "eval" / "eagle3_evaluation.json").read_text())
    assert served["drafter"] == str(out / "export"), served["drafter"]
    assert (served["prompts"], served["num_prompts"], served["max_new_tokens"], served["k"]) == (
        chain["prompts"], chain["num_prompts"], chain["max_new_tokens"], chain["k"])
    assert served["lossless"] is True and served["mismatches"] == 0
    card = str(build_model_card(out / "export"))
    assert "## Served by vLLM" in card
    assert f"τ = **{served['acceptance_length']:.2f}** from vLLM's own metrics" in card


@pytest.mark.slow
def test_demo_pipeline_tiny(demo):
    check_pipeline(demo)


@pytest.mark.slow
def test_demo_serves_the_export_in_vllm(vllm, demo):
    check_vllm(demo)


@pytest.mark.slow
def test_demo_serves_the_export_in_llamacpp(demo):
    """With `make llamacpp` built, the demo's llama.cpp stage served the export as a GGUF on the chain's questions,
    token-identical to plain llama-server."""
    from eagle3_hf.engines.llamacpp_env import STAMP, llamacpp_dir

    if not (llamacpp_dir() / STAMP).is_file():
        pytest.skip(f"llama.cpp is not built in {llamacpp_dir()}: `make llamacpp` adds the demo's llama.cpp stage")
    path = demo / "eval_llamacpp" / "eagle3_evaluation_llamacpp.json"
    assert path.is_file(), "llama.cpp is built but the demo skipped its llama.cpp stage"
    served = json.loads(path.read_text())
    chain = json.loads((demo / "eval" / "eagle3_evaluation.json").read_text())
    assert (served["prompts"], served["num_prompts"], served["max_new_tokens"], served["k"]) == (
        chain["prompts"], chain["num_prompts"], chain["max_new_tokens"], chain["k"])
    assert served["lossless"] is True and served["counters_agree"] and served["num_cycles"] > 0
