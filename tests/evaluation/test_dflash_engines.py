"""A DFlash drafter served by the engines (slow): written by hand in the one layout vLLM, SGLang and llama.cpp all
read (docs/contracts.md, "What engines read for DFlash"), with random weights, for the tiny next-token verifier the
EAGLE-3 engine tests serve (tests/helpers/served_pair.py). vLLM's CPU build serves it with the method "dflash"
(`evaluate --engine vllm`), llama.cpp converts it with its own converter (`export --format gguf`) and serves it with
`--spec-type draft-dflash` (`evaluate --engine llamacpp`): each answers token-identically to its plain decoding and
reports the drafts it offered and accepted. Random weights accept little; what is tested is that the engines load
the layout, draft with it and stay lossless."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_hf.engines.llamacpp_env import STAMP, llamacpp_dir

from tests.helpers.dflash_drafters import write_dflash_drafter
from tests.helpers.served_pair import chain_verifier

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")
PROMPTS = ("--prompts", "mt-bench", "--num-prompts", "3", "--max-new-tokens", "24", "--k", "3")
BLOCK = 4  # the drafter's block: the anchor and 3 masks, so --k 3 drafts every mask


@pytest.fixture(scope="module")
def dflash_pair(tmp_path_factory, tokenizer):
    """(verifier dir with the SmolLM2 tokenizer, DFlash drafter dir in the engines' layout)."""
    root = tmp_path_factory.mktemp("dflash_pair")
    verifier = chain_verifier()
    verifier.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    drafter = write_dflash_drafter(root / "drafter", verifier.config.to_dict(), layers=2, block_size=BLOCK)
    return root / "verifier", drafter


def evaluate(engine: str, verifier: Path, drafter: Path, out: Path, *extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([EAGLE3_HF, "evaluate", "--engine", engine, "--skip-transformers", "--drafter",
                             str(drafter), "--verifier", str(verifier), *PROMPTS, *extra, "--no-progress",
                             "--output", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / f"eagle3_evaluation_{engine}.json").read_text())


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
    assert served["num_drafts"] > 0 and len(served["per_position_acceptance"]) == 3
    assert served["acceptance_length"] >= 1.0
    steps = [a for row in served["per_prompt"] for a in row["accepted_per_step"]]
    assert steps and all(0 <= a <= 3 for a in steps)


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
    assert drafted and max(drafted) <= 3
