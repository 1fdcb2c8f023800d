"""gpu_check/gpu_check.sh's CPU path: the same code as on the GPU at a tiny shape, one JSON with every required part
passed, run without the packages the GPU image lacks; its bf16 gate failing when bf16 training is broken; its
deadline stopping the run and saying so."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# dependencies of the project that the GPU machine's image does not have (its package list: gpu_check/README.md)
NOT_ON_THE_GPU_IMAGE = ("datasets", "deepspeed", "evaluate", "gguf")


def counted_step_flops(row_len: int, documents: int) -> int:
    """FLOPs of one CPU training step at gpu_check's tiny shape, counted by PyTorch as the step runs (every matmul,
    forward and backward): independent of the plan's formula
    (eagle3_hf.train.plan_drafter.Eagle3Arithmetic.train_flops_per_token). The CPU's sdpa kernel is not counted:
    attention is the plan's share beyond this count."""
    from torch.utils.flop_counter import FlopCounterMode

    from eagle3_hf import Eagle3Config

    from gpu_check.gpu_check import TINY_TEXT_CONFIG
    from gpu_check.train_step import make_train_step, new_drafter, packed_row

    config = Eagle3Config.from_verifier(TINY_TEXT_CONFIG, draft_vocab_size=256, ttt_steps=3)
    config._attn_implementation = "sdpa"
    model = new_drafter(config, "cpu")
    step = make_train_step(model, "cpu", bf16=False)
    batch = packed_row(config, row_len, documents, "cpu")
    with FlopCounterMode(display=False) as counter:
        step(batch)
    return counter.get_total_flops()


@pytest.mark.slow
def test_gpu_check_cpu_tiny_writes_a_passing_report_without_what_the_gpu_image_lacks(tmp_path):
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(  # `import X` fails and find_spec(X) is None, as where X is absent
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in NOT_ON_THE_GPU_IMAGE))
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", PYTHONPATH=str(blocker))
    proc = subprocess.run([str(ROOT / "gpu_check/gpu_check.sh"), "--device", "cpu", "--tiny", "--steps", "2",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and not report["failed"] and report["tiny"] and report["device"] == "cpu"
    parts = report["parts"]
    assert set(parts) == {"train_step/tiny", "bf16_gate/tiny", "extract_speculative", "greedy_head", "loader",
                          "hashing"}
    assert report["optional"]["flex_attention"] == {"skipped": "PyTorch has no flex_attention backward on the CPU"}
    row = parts["train_step/tiny"]
    assert row["attn_implementation"] == "sdpa" and len(row["step_s"]) == 2 and row["tokens"] == 256
    assert row["shape"] == "tiny" and row["ttt_steps"] == 3
    # the real Trainer's micro-step: at most the one read of the non-finite guard, as tests/train/test_host_syncs.py
    assert row["host_syncs_per_micro_step"] <= 2, row["host_sync_ops"]
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / statistics.median(row["step_s"]))  # timed steps
    assert row["loss_finite"] and row["losses"][-1] < row["losses"][0]  # the optimizer stepped
    # MFU divides by the plan's model FLOPs: they are the step's, as PyTorch counts them, within 10% (attention,
    # which the counter does not see on the CPU, and the positions past a document's end that no head reads)
    counted = counted_step_flops(row["tokens"], row["documents"])
    assert row["model_tflop_per_step"] * 1e12 == pytest.approx(counted, rel=0.10), (row["model_tflop_per_step"],
                                                                                    counted / 1e12)
    # the step's memory (the resident set's peak above its start) is what `eagle3-hf plan` predicts, within 50% at
    # this tiny shape (tests/train/test_plan.py holds the activation model to 15% at a larger one)
    assert 0.5 <= row["step_memory_measured_over_plan"] <= 1.5, row
    gate = parts["bf16_gate/tiny"]
    assert gate["ok"] and len(gate["move_rel_err"]) == 3 and max(gate["move_rel_err"]) < gate["move_rtol"]
    assert min(gate["fp32_change_rel"]) > 0  # the steps moved the logits: there was a change to compare
    spec = parts["extract_speculative"]
    assert spec["lossless_ok"] and set(spec["lossless"]) <= {"match", "tie"}
    assert spec["last_loss"] < spec["first_loss"] / 2  # the drafter learned from the extracted features
    assert spec["tokens_per_verifier_forward"] > 1.0  # and speculative decoding accepted some of its drafts
    head = parts["greedy_head"]
    assert head["ok"] and head["bf16_agreement_with_fp32"] == 1.0 and head["bf16_tokens_per_s"] > 0
    assert parts["loader"]["rows_per_s"]["workers_0"] > 0 and parts["loader"]["plan"]["gpus"] == 8
    assert parts["hashing"]["same_digests"] and parts["hashing"]["gb_per_s_1_thread"] > 0


def gate(tmp_path: Path) -> dict:
    from eagle3_hf import Eagle3Config

    from gpu_check.bf16_gate import bf16_gate
    from gpu_check.gpu_check import TINY_TEXT_CONFIG

    config = Eagle3Config.from_verifier(TINY_TEXT_CONFIG, draft_vocab_size=256, ttt_steps=3)
    return bf16_gate(config, "cpu", 3, 256, 4, tmp_path)


def test_the_bf16_gate_fails_when_bf16_training_keeps_bf16_weights(tmp_path, monkeypatch):
    """As built, --bf16 trains on fp32 master weights under autocast: the gate passes. Cast the drafter to bf16
    under --bf16 (an update of lr 3e-5 is below half a bf16 step of a 0.02 weight: rounded away) and the per-step
    logits no longer move as fp32 training moves them: the gate fails, on the logits, not on a loss."""
    from eagle3_hf.train.trainer import Eagle3Trainer

    good = gate(tmp_path / "good")
    assert good["ok"], good
    create = Eagle3Trainer.create_optimizer

    def bf16_weights(self, model=None):
        if self.args.bf16:
            self.model.to(torch.bfloat16)
        return create(self, model)

    monkeypatch.setattr(Eagle3Trainer, "create_optimizer", bf16_weights)
    broken = gate(tmp_path / "broken")
    assert not broken["ok"] and min(broken["move_rel_err"]) > broken["move_rtol"], broken
    assert broken["forward_rel_err"] == good["forward_rel_err"]  # the fp32 run, unchanged: only bf16 training broke


def test_the_deadline_stops_the_run_and_the_report_says_what_did_not_run(tmp_path):
    from gpu_check.gpu_check import main

    out = tmp_path / "gpu_check.json"
    t0 = time.monotonic()
    code = main(["--device", "cpu", "--tiny", "--steps", "2", "--deadline-s", "0.3", "--out", str(out)])
    assert code == 1 and time.monotonic() - t0 < 30
    report, order = json.loads(out.read_text()), ["train_step/tiny", "bf16_gate/tiny", "extract_speculative",
                                                  "greedy_head", "loader", "hashing"]
    parts = report["parts"]
    done = [name for name in order if name in parts and not {"skipped", "error"} & set(parts[name])]
    cut = order[len(done):]  # the parts run in order: those after the deadline did not complete
    assert not report["ok"] and cut and done == order[:len(done)] and len(report["failed"]) == len(cut)
    said = [parts.get(name, {}).get("skipped", "") for name in cut]
    assert said[0].startswith("interrupted at the deadline") or report.get("notes"), said  # stopped mid-part
    assert all(s.startswith("deadline") for s in said[1:] if s), said  # the rest never started
