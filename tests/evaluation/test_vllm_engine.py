"""vLLM's CPU build serves our drafters: `eagle3-hf evaluate --engine vllm`, its one-line errors, and (slow) a
trained drafter served by vLLM, token-identical to plain vLLM and accepting what our own decoder accepts.

The slow tests need `make vllm` (the `make test` target installs it, cached outside the clone); without it
they fail, unless EAGLE3_HF_SKIP_VLLM=1 is set (locally only, never in CI): tests/helpers/vllm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_hf.cli import main
from eagle3_hf.engines.vllm.vllm_env import one_line
from eagle3_hf.evaluation.vllm_engine import cut_final_step

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")


def evaluate_cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([EAGLE3_HF, "evaluate", *args, "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------- slow: a trained drafter served by vLLM

# Greedy fp32: vLLM accepts exactly the drafts our decoder accepts, step by step, once vLLM's final step is
# counted as evaluate counts it (cut at max tokens). A prompt may differ only where the two engines' different
# kernels meet a near-tie of the verifier ("numerics"); at most one of these four, and the gap stays within:
TAU_TOLERANCE = 0.02


@pytest.mark.slow
@pytest.mark.timeout(900)  # the session's vLLM evaluation (conftest.py) included
def test_vllm_serves_a_trained_drafter_like_our_decoder(vllm_evaluation):
    served, ours = vllm_evaluation.served, vllm_evaluation.ours
    assert "train/serve gap (vLLM tau - transformers tau): " in vllm_evaluation.stdout
    assert served["engine"] == "vllm" and served["vllm_version"] == "0.32.0" and ours["engine"] == "transformers"
    # token-identical to plain vLLM at temperature 0
    assert served["lossless"] is True and served["mismatches"] == 0
    assert all(r["lossless"] in ("match", "tie") for r in served["per_prompt"])
    # τ from vLLM's own counters, above 1; the per-step record adds up to the same counters
    assert served["acceptance_length"] > 1.2, served["acceptance_length"]
    for row in served["per_prompt"]:
        assert sum(row["accepted_per_step"]) == row["accepted"] and len(row["accepted_per_step"]) == row["drafts"]
    assert served["num_drafts"] == sum(r["drafts"] for r in served["per_prompt"]) > 0
    # the same acceptance as our decoder on the same prompts
    assert served["prompts_equal"] + served["prompts_numerics"] == served["num_compared"] == 4
    assert served["prompts_differ"] == 0 and served["prompts_numerics"] <= 1
    assert abs(served["gap"]) <= TAU_TOLERANCE, served["gap"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_loads_the_drafter_by_repo_id_from_the_hub(vllm_evaluation):
    """`eagle3-hf push` to the loopback Hub, then vLLM (and our decoder) downloaded the drafter by repo id through
    HF_ENDPOINT into an empty cache (conftest.py's `vllm_evaluation`)."""
    served = vllm_evaluation.served
    assert served["drafter"] == vllm_evaluation.repo_id == "tester/chain-eagle3" and served["lossless"] is True
    assert served["acceptance_length"] > 1.2
    assert list((vllm_evaluation.hf_home / "hub").glob("models--tester--chain-eagle3/snapshots/*/model.safetensors"))


# ---------------------------------------------------------------- fast: the final-step accounting and the errors


def test_cut_final_step_counts_like_evaluate():
    # 16 tokens: the prefill's, then steps emitting 3, 1, 4, 4 (13 in all); the last step emitted 3 more
    steps = [2, 0, 3, 3, 3]
    assert cut_final_step(steps, output_len=16, max_new_tokens=16) == [2, 0, 3, 3, 2]  # 2 drafts + the bonus
    assert cut_final_step(steps, output_len=16, max_new_tokens=20) == [2, 0, 3, 3, 3]  # ended on an eos draft
    assert cut_final_step([2, 0, 1], output_len=7, max_new_tokens=16) == [2, 0, 1]  # eos as the bonus token
    assert cut_final_step([1, 3], output_len=7, max_new_tokens=7) == [1, 3]  # nothing to cut
    assert cut_final_step([], output_len=1, max_new_tokens=1) == []


def test_vllm_missing_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(tmp_path / "nowhere"))
    code = main(["evaluate", "--engine", "vllm", "--drafter", str(tmp_path), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: vLLM is not installed: run `make vllm`") and "\n" not in err


def test_verifier_drafter_mismatch_is_one_line(fake_vllm_venv, tiny_verifier_dir, tmp_path, capsys):
    from tests.helpers.drafters import write_drafter  # hidden and vocabulary of another verifier

    drafter = write_drafter(tmp_path / "drafter")
    code = main(["evaluate", "--engine", "vllm", "--drafter", str(drafter), "--verifier", str(tiny_verifier_dir),
                 "--num-prompts", "1", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: drafter and verifier do not fit") and "vocab_size" in err[-1]


def test_a_refusal_inside_the_vllm_venv_is_one_line(fake_vllm_venv, tiny_verifier_dir, tmp_path, capsys):
    """The runner's exception crosses the process boundary as JSON and ends as one line; --debug (here
    EAGLE3_HF_DEBUG) would print its traceback. Our venv has no vllm, so the runner fails at its import."""
    from tests.helpers.drafters import random_drafter
    from tests.helpers.verifiers import make_tiny_verifier

    drafter = tmp_path / "drafter"
    random_drafter(make_tiny_verifier(), draft_vocab_size=256).save_pretrained(drafter)
    code = main(["evaluate", "--engine", "vllm", "--drafter", str(drafter), "--verifier", str(tiny_verifier_dir),
                 "--num-prompts", "1", "--max-new-tokens", "4", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1] == f"error: vLLM refused the drafter {drafter}: ModuleNotFoundError: No module named 'vllm'"


VLLM_VALIDATION_ERROR = (  # vLLM's message, verbatim
    "1 validation error for SpeculativeConfig\n"
    "  Value error, Eagle3 is only supported for ['llama', 'qwen'] models. "
    "Got self.target_model_config.hf_text_config.model_type='gpt2' "
    "[type=value_error, input_value=ArgsKwargs((), {...}), input_type=ArgsKwargs]\n"
    "    For further information visit https://errors.pydantic.dev/2.12/v/value_error")


def test_one_line_of_vllm_exceptions():
    assert one_line({"type": "ValidationError", "full_message": VLLM_VALIDATION_ERROR}) == (
        "Eagle3 is only supported for ['llama', 'qwen'] models. Got "
        "self.target_model_config.hf_text_config.model_type='gpt2'")
    wrapped = {"type": "RuntimeError", "full_message": "Engine core initialization failed. See root cause above.\n"}
    assert one_line(wrapped) == "RuntimeError: Engine core initialization failed. See root cause above."
    assert one_line({"type": "KeyError", "full_message": "", "traceback": "Traceback ...\nKeyError: 'd2t'\n"}) == (
        "KeyError: 'd2t'")
    long = one_line({"type": "ValueError", "full_message": "There is no parameter named 'x'. " + "y" * 1000})
    assert long.startswith("ValueError: There is no parameter named 'x'.") and len(long) < 300


def test_model_card_states_the_tau_measured_in_vllm(fake_vllm_venv, tiny_verifier_dir, tmp_path, monkeypatch):
    """`evaluate --engine vllm --write-to-drafter`, vLLM's runner replaced by its answer for one prompt, then the
    card built from the drafter directory: it states vLLM's τ and the gap, worked out here from the counts."""
    from eagle3_hf.evaluation import vllm_engine
    from eagle3_hf.publish.model_card import build_model_card

    from tests.helpers.drafters import random_drafter
    from tests.helpers.verifiers import make_tiny_verifier

    drafter = tmp_path / "drafter"
    random_drafter(make_tiny_verifier(), draft_vocab_size=256).save_pretrained(drafter)
    assert "Served by vLLM" not in str(build_model_card(drafter))
    tokens = list(range(5, 13))  # 8 new tokens, the same with and without the drafter (greedy)
    # three verify steps accepting 3, 0 and 2 of 3 drafts: τ = 1 + 5/3; the last step's 2 accepted drafts and
    # bonus token pass max tokens after 1 of them, so counted as evaluate counts: 1 + (3 + 0 + 1)/3
    runner = {"vllm_version": "0.32.0",
              "plain": {"outputs": [tokens], "seconds": [2.0], "margins": [[1.0] * 8]},
              "spec": {"outputs": [tokens], "seconds": [1.0], "margins": [[1.0] * 8],
                       "spec": [{"drafts": 3, "accepted": 5, "accepted_per_pos": [2, 2, 1],
                                 "per_step_accepted": [3, 0, 2]}]}}
    monkeypatch.setattr(vllm_engine, "run_vllm", lambda request, **_: runner)
    out = tmp_path / "eval"
    assert main(["evaluate", "--engine", "vllm", "--drafter", str(drafter), "--verifier", str(tiny_verifier_dir),
                 "--num-prompts", "1", "--max-new-tokens", "8", "--k", "3", "--output", str(out),
                 "--write-to-drafter", "--no-progress"]) == 0
    ours = json.loads((out / "eagle3_evaluation.json").read_text())["acceptance_length"]
    card = str(build_model_card(drafter))
    assert "## Served by vLLM" in card and "In vLLM 0.32.0" in card and "num_speculative_tokens = 3" in card
    assert "τ = **2.67** from vLLM's own metrics, speedup 2.00× over plain vLLM" in card
    assert "mt-bench (1 prompts x 8 tokens)" in card and "token-identical to plain vLLM: yes" in card
    assert f"eagle3_hf's own decoder on the same prompts: τ = {ours:.2f}" in card
    assert f"train/serve gap (vLLM − ours, final step counted alike) {1 + 4 / 3 - ours:+.3f}" in card
