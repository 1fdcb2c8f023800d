"""`evaluate --engine vllm` at a node's scale: the shared engine options reach vLLM as named, the dtype is bf16 on a
GPU and fp32 on the CPU, and the plain and speculative engines share the machine as stated: one after the other
(the plain engine's process gone before the speculative one loads) or together with the memory split. vLLM is
replaced by a fake runner process here; the real CPU build runs the same two layouts in the slow test at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_hf import cli
from eagle3_hf.engines.vllm import vllm_args
from eagle3_hf.engines.vllm.vllm_request import GenerationRequest
from eagle3_hf.evaluation import vllm_engine

from tests.helpers.served_pair import VLLM_EVALUATION_ARGS

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")

TOKENS = list(range(5, 13))  # 8 new tokens, equal with and without the drafter (greedy)
RUN = {"outputs": [TOKENS], "seconds": [1.0], "margins": [[1.0] * 8]}
SPEC = {"drafts": 3, "accepted": 5, "accepted_per_pos": [2, 2, 1], "per_step_accepted": [3, 0, 2]}


class FakeEngines:
    """vllm_env.run_vllm's stand-in: each call is one runner process that loads the engines its request asks for
    (plain unless "plain": false, speculative with a drafter), decodes, and exits, releasing them. It records the
    requests and the most engines ever loaded at once."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.alive: list[str] = []
        self.most_at_once = 0

    def __call__(self, typed: GenerationRequest, **_: object) -> dict:
        request = typed.to_json()  # what the runner would read
        self.requests.append(request)
        modes = (["plain"] if request.get("plain", True) else []) + (["spec"] if request.get("drafter") else [])
        self.alive += modes  # loaded
        self.most_at_once = max(self.most_at_once, len(self.alive))
        result = {"vllm_version": "0.32.0", **{m: dict(RUN, spec=[SPEC] if m == "spec" else None) for m in modes}}
        for mode in modes:  # the process exits: its engines and their memory go with it
            self.alive.remove(mode)
        return result


@pytest.fixture
def drafter_dir(tmp_path):
    from tests.helpers.drafters import random_drafter
    from tests.helpers.verifiers import make_tiny_verifier

    path = tmp_path / "drafter"
    random_drafter(make_tiny_verifier(), draft_vocab_size=256).save_pretrained(path)
    return path


def evaluate(drafter, verifier, out, *flags: str) -> int:
    return cli.main(["evaluate", "--engine", "vllm", "--drafter", str(drafter), "--verifier", str(verifier),
                     "--num-prompts", "1", "--max-new-tokens", "8", "--k", "3", "--skip-transformers",
                     "--no-progress", "--output", str(out), *flags])


KIMI_FLAGS = ("--tensor-parallel-size", "8", "--enable-expert-parallel", "--gpu-memory-utilization", "0.85",
              "--max-num-batched-tokens", "16384", "--trust-remote-code")


def test_the_shared_engine_group_reaches_vllm_as_named():
    args = cli.command_parser("evaluate").parse_args(["--engine", "vllm", "--drafter", "d", "--output", "o",
                                                      *KIMI_FLAGS])
    engine = vllm_args.engine_from_args(args)
    assert vllm_args.llm_kwargs(engine, cpu=False) == {
        "enforce_eager": False, "tensor_parallel_size": 8, "enable_expert_parallel": True,
        "gpu_memory_utilization": 0.85, "max_num_batched_tokens": 16384, "trust_remote_code": True}


def test_on_a_gpu_bf16_and_one_engine_at_a_time(fake_vllm_venv, tiny_verifier_dir, drafter_dir, tmp_path,
                                                 monkeypatch, capsys):
    engines = FakeEngines()
    monkeypatch.setattr(vllm_args, "gpu_present", lambda: True)  # nvidia-smi lists a GPU
    monkeypatch.setattr(vllm_engine, "run_vllm", engines)
    assert evaluate(drafter_dir, tiny_verifier_dir, tmp_path / "o", *KIMI_FLAGS) == 0
    assert "one engine at a time (the plain one exits before the speculative one loads)" in capsys.readouterr().err
    plain, spec = engines.requests
    assert plain["drafter"] is None and plain.get("plain", True)  # the plain engine alone, first
    assert spec["drafter"] == str(drafter_dir) and spec["plain"] is False  # then the speculative one alone
    assert engines.most_at_once == 1
    for request in (plain, spec):  # each engine takes the whole memory asked for, in bf16
        assert request["dtype"] == "bfloat16"
        assert request["engine"]["gpu_memory_utilization"] == 0.85
        assert request["engine"]["tensor_parallel_size"] == 8 and request["engine"]["enable_expert_parallel"]
        assert request["engine"]["trust_remote_code"] is True
    summary = json.loads((tmp_path / "o" / "eagle3_evaluation_vllm.json").read_text())
    assert summary["dtype"] == "bfloat16" and summary["engines"] == "sequential"
    assert summary["acceptance_length"] == pytest.approx(1 + 5 / 3) and summary["lossless"] is True


def test_together_splits_the_memory(fake_vllm_venv, tiny_verifier_dir, drafter_dir, tmp_path,
                                    monkeypatch, capsys):
    engines = FakeEngines()
    monkeypatch.setattr(vllm_args, "gpu_present", lambda: True)
    monkeypatch.setattr(vllm_engine, "run_vllm", engines)
    assert evaluate(drafter_dir, tiny_verifier_dir, tmp_path / "o", "--vllm-engines", "together",
                    "--gpu-memory-utilization", "0.9") == 0
    assert "each given 0.45 of every GPU's memory" in capsys.readouterr().err
    (request,) = engines.requests
    assert engines.most_at_once == 2 and request["engine"]["gpu_memory_utilization"] == 0.45


def test_on_the_cpu_fp32_and_both_engines_in_one_process(fake_vllm_venv, tiny_verifier_dir, drafter_dir,
                                                         tmp_path, monkeypatch):
    engines = FakeEngines()
    monkeypatch.setattr(vllm_args, "gpu_present", lambda: False)
    monkeypatch.setattr(vllm_engine, "run_vllm", engines)
    assert evaluate(drafter_dir, tiny_verifier_dir, tmp_path / "o") == 0
    (request,) = engines.requests  # one process, prompts timed back to back; the CPU has no GPU memory to split
    assert request["dtype"] == "float32" and request.get("plain", True) and request["drafter"]
    assert request["engine"]["gpu_memory_utilization"] is None
    # the context the prompt needs: itself, 8 new tokens and the k + 1 tokens of the last verify step
    assert request["max_model_len"] == len(request["prompts"][0]) + 8 + 3 + 1


def test_data_parallel_is_refused_in_one_line(tmp_path, capsys):
    code = cli.main(["evaluate", "--engine", "vllm", "--drafter", str(tmp_path), "--output", str(tmp_path / "o"),
                     "--data-parallel-size", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "\n" not in err and err.startswith("error: --engine vllm decodes one prompt at a time")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_engine_at_a_time_measures_what_both_together_measure(served_pair, vllm_evaluation, tmp_path):
    """vLLM's CPU build, the trained drafter: the plain and the speculative engine in two processes one after the
    other give the same tokens, the same accepted drafts at every step, and the same lossless verdict as both
    engines in one process (the session's `vllm_evaluation`, conftest.py: greedy decoding is deterministic there)."""
    verifier, drafter = served_pair
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = tmp_path / "sequential"
    result = subprocess.run([EAGLE3_HF, "evaluate", "--engine", "vllm", "--drafter", str(drafter), "--verifier",
                             str(verifier), *VLLM_EVALUATION_ARGS, "--skip-transformers", "--vllm-engines",
                             "sequential", "--no-progress", "--output", str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    one, both = json.loads((out / "eagle3_evaluation_vllm.json").read_text()), vllm_evaluation.served
    assert one["engines"] == "sequential" and both["engines"] == "together" and one["dtype"] == "float32"
    assert one["lossless"] is True and both["lossless"] is True and one["mismatches"] == 0
    assert "gap" not in one  # --skip-transformers: nothing of ours to compare with
    assert [r["tokens"] for r in one["per_prompt"]] == [r["tokens"] for r in both["per_prompt"]]
    assert [r["accepted_per_step"] for r in one["per_prompt"]] == [r["accepted_per_step"] for r in both["per_prompt"]]
    assert one["acceptance_length"] == both["acceptance_length"] > 1.2
