"""A DFlash drafter of our own class served by the engines (slow), beside our decoder on the same 10 MT-bench
questions: vLLM's CPU build serves it with the method "dflash" (`evaluate --engine vllm`), llama.cpp converts it
with its own converter (`export --format gguf`) and serves it with `--spec-type draft-dflash` (`evaluate --engine
llamacpp`). Each answers token-identically to its plain decoding, and accepts what our decoder accepts: the
drafter (`accepting_dflash_pair` in tests/helpers/dflash_drafters.py) has its blocks accepted whole in some cycles
and partly or not at all in others (τ about 2.2 of 5), so an engine reading the layout otherwise (aux layers, mask
token, block attention, RoPE) moves τ by more than the 0.02 asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_hf.engines.llamacpp_env import STAMP, llamacpp_dir

from tests.helpers.dflash_drafters import ACCEPTING_BLOCK, accepting_dflash_pair

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")
K = ACCEPTING_BLOCK - 1  # every mask of the block drafted
PROMPTS = ("--prompts", "mt-bench", "--num-prompts", "10", "--max-new-tokens", "24", "--k", str(K))
TAU_GAP = 0.02  # the engine's τ (counted as evaluate counts it) against our decoder's


@pytest.fixture(scope="module")
def dflash_pair(tmp_path_factory, tokenizer):
    """(verifier dir with the SmolLM2 tokenizer, DFlash drafter dir)."""
    return accepting_dflash_pair(tmp_path_factory.mktemp("dflash_pair"), tokenizer, questions=10)


def evaluate(engine: str, verifier: Path, drafter: Path, out: Path, *extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([EAGLE3_HF, "evaluate", "--engine", engine, "--drafter",
                             str(drafter), "--verifier", str(verifier), *PROMPTS, *extra, "--no-progress",
                             "--output", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    served = json.loads((out / f"eagle3_evaluation_{engine}.json").read_text())
    ours = json.loads((out / "eagle3_evaluation.json").read_text())
    assert ours["lossless"] is True and ours["acceptance_length"] > 1.5, ours["acceptance_length"]  # drafts accepted
    return served


def assert_accepts_as_ours(served: dict) -> None:
    """The engine's τ as evaluate counts it within TAU_GAP of our decoder's on the same questions."""
    assert abs(served["gap"]) <= TAU_GAP, (served["acceptance_length_as_evaluate_counts"],
                                           served["transformers_acceptance_length"], served["prompt_agreement"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_serves_a_dflash_drafter_losslessly(dflash_pair, tmp_path):
    from tests.helpers.vllm import vllm_or_fail

    vllm_or_fail()
    verifier, drafter = dflash_pair
    served = evaluate("vllm", verifier, drafter, tmp_path / "eval", "--vllm-engines", "together")
    assert served["engine"] == "vllm" and (served["drafter_kind"], served["vllm_method"]) == ("dflash", "dflash")
    # token-identical to plain vLLM at temperature 0
    assert served["lossless"] is True and served["mismatches"] == 0
    # vLLM's own counters: a verify step per cycle, k drafts each, per-position acceptance for the k positions
    assert served["num_drafts"] > 0 and len(served["per_position_acceptance"]) == K
    steps = [a for row in served["per_prompt"] for a in row["accepted_per_step"]]
    assert steps and all(0 <= a <= K for a in steps) and 0 in steps and K in steps  # whole blocks and none
    assert_accepts_as_ours(served)


def llamacpp_built() -> bool:
    return (llamacpp_dir() / STAMP).is_file()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llamacpp_converts_and_serves_a_dflash_drafter_losslessly(dflash_pair, tmp_path):
    if not llamacpp_built():
        pytest.skip(f"llama.cpp is not built in {llamacpp_dir()}: `make llamacpp` builds it")
    verifier, drafter = dflash_pair
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    exported = subprocess.run([EAGLE3_HF, "export", str(drafter), "--format", "gguf", "--verifier", str(verifier),
                               "--verifier-gguf", "convert", "--gguf-type", "f32", "--output", str(tmp_path / "gguf")],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert exported.returncode == 0, exported.stdout[-3000:] + exported.stderr[-3000:]
    gguf = tmp_path / "gguf" / "dflash-drafter-f32.gguf"
    assert gguf.is_file() and "--spec-type draft-dflash" in exported.stdout
    served = evaluate("llamacpp", verifier, drafter, tmp_path / "eval")
    assert served["engine"] == "llamacpp" and served["spec_type"] == "draft-dflash"
    # token-identical to plain llama-server at temperature 0
    assert served["lossless"] is True and served["mismatches"] == 0
    # the server's draft counters: drafts offered every cycle (p-min 0), at most k each, the stream's cycles adding up
    assert served["num_drafts"] > 0 and served["counters_agree"]
    drafted = [d for row in served["per_prompt"] for d in row["drafted_per_step"]]
    assert drafted and max(drafted) <= K
    assert_accepts_as_ours(served)
