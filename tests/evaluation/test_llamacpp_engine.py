"""llama.cpp serves our drafters: `export --format gguf`, `evaluate --engine llamacpp`, their one-line errors, and
(slow) a trained drafter served by llama-server, token-identical to plain llama-server and accepting what our own
decoder accepts.

The slow test needs `make llamacpp` (llama-server built from llama-cpp-python's source distribution, cached
outside the clone); without the build it is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_hf.cli import main
from eagle3_hf.engines.llamacpp_env import STAMP, llamacpp_dir
from eagle3_hf.engines.llamacpp_server import Completion, steps_from_stream
from eagle3_hf.evaluation.llamacpp_engine import summarize

from tests.helpers.drafters import write_drafter, write_verifier_config

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")


def built() -> bool:
    return (llamacpp_dir() / STAMP).is_file()


# ---------------------------------------------------------------- fast: the cycle accounting and the errors


def test_the_stream_splits_into_verify_cycles():
    # prefill token; a cycle drafting 3, accepting 2 (3 tokens); a cycle without a draft (counters unchanged);
    # a cycle drafting 3, accepting 0; the last cycle drafting 1 (max tokens near), accepting 1 (2 tokens)
    counters = [(0, 0), (3, 2), (3, 2), (3, 2), (3, 2), (6, 2), (7, 3), (7, 3)]
    assert steps_from_stream(counters) == ([3, 0, 3, 1], [2, 0, 0, 1])
    assert steps_from_stream([(0, 0)]) == ([], [])
    # an eos among the accepted drafts ends the stream early: the cycle is still counted whole
    assert steps_from_stream([(0, 0), (3, 3), (3, 3)]) == ([3], [3])


def completion(tokens, drafted, accepted, seconds, margins=None):
    return Completion(tokens=tokens, margins=margins or [float("inf")] * len(tokens), drafted=drafted,
                      accepted=accepted, seconds=seconds, prompt_seconds=0.0, draft_n=sum(drafted),
                      draft_n_accepted=sum(accepted))


def test_summary_counts_both_taus_and_checks_identity():
    plain = [completion([1, 2, 3, 4, 5], [], [], 1.0), completion([6, 7, 8], [], [], 1.0)]
    spec = [completion([1, 2, 3, 4, 5], [3, 0], [2, 0], 0.5),  # 1 + 3 + 1 tokens
            completion([6, 7, 9], [2], [1], 0.8, margins=[9.0, 9.0, 1e-6])]  # a tie at the last token
    s = summarize(plain, spec, k=3, temperature=0.0, p_min=0.75)
    assert s["acceptance_length"] == pytest.approx(1 + 3 / 2)  # cycles that drafted
    assert s["acceptance_length_as_evaluate_counts"] == pytest.approx(1 + 3 / 3)  # every cycle
    assert s["per_position_acceptance"] == [pytest.approx(1.0), pytest.approx(0.5), pytest.approx(0.0)]
    assert s["lossless"] is True and s["numerical_ties"] == 1 and s["counters_agree"]
    assert s["speedup"] == pytest.approx((8 / 1.3) / (8 / 2.0))
    low, high = s["speedup_interval"]
    assert low <= s["speedup"] <= high
    spec[1] = completion([6, 7, 9], [2], [1], 0.8, margins=[9.0, 9.0, 5.0])
    assert summarize(plain, spec, k=3, temperature=0.0, p_min=0.0)["mismatches"] == 1


def test_llamacpp_missing_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLE3_HF_LLAMACPP_DIR", str(tmp_path / "nowhere"))
    code = main(["evaluate", "--engine", "llamacpp", "--drafter", str(tmp_path), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: llama.cpp is not built in") and "make llamacpp" in err
    assert "\n" not in err


def test_export_gguf_refuses_before_any_conversion(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setenv("EAGLE3_HF_LLAMACPP_DIR", str(tmp_path / "nowhere"))
    verifier = write_verifier_config(tmp_path / "verifier")
    fc_norm = {f"fc_norm.{i}.weight": torch.ones(64) for i in range(3)}
    eagle31 = write_drafter(tmp_path / "d31", fc_norm=True, replace=fc_norm)
    code = main(["export", str(eagle31), "--format", "gguf", "--verifier", str(verifier), "--output",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[0].strip().startswith("ERROR   llamacpp-fc-norm")
    assert err[-1].startswith("error: ") and "nothing was converted" in err[-1]
    assert not (tmp_path / "out").exists()
    good = write_drafter(tmp_path / "good")  # passes the rules: then the missing build is the one line
    code = main(["export", str(good), "--format", "gguf", "--verifier", str(verifier), "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: llama.cpp is not built") and "\n" not in err
    code = main(["export", str(good), "--format", "gguf", "--output", str(tmp_path / "o")])
    assert code == 1 and "needs --verifier" in capsys.readouterr().err


# ---------------------------------------------------------------- slow: a trained drafter served by llama-server

# Greedy, both verifiers in fp32 (the verifier's directory converted at f32, like the drafter): llama.cpp accepts
# what our decoder accepts, cycle by cycle, on prompts where the two engines' kernels give the same answer
TAU_TOLERANCE = 0.03


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_llamacpp_serves_a_trained_drafter_like_our_decoder(served_pair, tmp_path):
    if not built():
        pytest.skip(f"llama.cpp is not built in {llamacpp_dir()}: `make llamacpp` builds it")
    verifier, drafter = served_pair
    out = tmp_path / "eval"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([EAGLE3_HF, "evaluate", "--engine", "llamacpp", "--drafter", str(drafter), "--verifier",
                             str(verifier), "--prompts", "mt-bench", "--num-prompts", "4", "--max-new-tokens", "32",
                             "--k", "3", "--output", str(out), "--no-progress"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=880)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "train/serve gap (llama.cpp tau - transformers tau): " in result.stdout
    served = json.loads((out / "eagle3_evaluation_llamacpp.json").read_text())
    assert served["engine"] == "llamacpp" and served["verifier_gguf"].endswith("-f32.gguf")
    # token-identical to plain llama-server at temperature 0
    assert served["lossless"] is True and served["mismatches"] == 0
    # τ from the server's own counters, above 1, and the stream's cycles add up to them
    assert served["counters_agree"] and served["acceptance_length"] > 1.2, served["acceptance_length"]
    assert served["num_drafts"] > 0 and served["num_accepted_tokens"] > 0
    # the same acceptance as our decoder on the same prompts
    assert served["prompts_differ"] == 0 and served["prompts_numerics"] <= 1
    assert abs(served["gap"]) <= TAU_TOLERANCE, served["gap"]
