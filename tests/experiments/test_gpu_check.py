"""gpu_check/gpu_check.sh's CPU path: the same code as on the GPU (the real Trainer's step) at a tiny shape, one JSON
with every part passed."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def counted_step_flops(gpu_check, row_len: int, documents: int) -> int:
    """FLOPs of one CPU training step at gpu_check's tiny shape, counted by PyTorch as the step runs (every matmul,
    forward and backward): independent of the plan's formula (eagle3_hf.train.plan.train_flops_per_token). The
    CPU's sdpa kernel is not counted: attention is the plan's share beyond this count."""
    from torch.utils.flop_counter import FlopCounterMode

    from eagle3_hf import Eagle3Config, Eagle3DraftModel

    config = Eagle3Config.from_verifier(gpu_check.TINY_TEXT_CONFIG, draft_vocab_size=256, ttt_steps=3)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    model.load_verifier_embeddings(torch.randn(config.vocab_size, config.hidden_size) * 0.02)
    model.attach_teacher(torch.randn(config.vocab_size, config.target_hidden_size) * 0.02)
    step = gpu_check.make_train_step(model.train(), "cpu", bf16=False)
    batch = gpu_check.packed_row(config, row_len, documents, "cpu")
    with FlopCounterMode(display=False) as counter:
        step(batch)
    return counter.get_total_flops()


@pytest.mark.slow
def test_gpu_check_cpu_tiny_writes_a_passing_report(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run([str(ROOT / "gpu_check/gpu_check.sh"), "--device", "cpu", "--tiny", "--steps", "2",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and not report["errors"] and report["tiny"] and report["device"] == "cpu"
    (row,) = report["train_step"]
    assert row["attn_implementation"] == "sdpa" and len(row["step_s"]) == 2 and row["tokens"] == 256
    assert row["shape"] == "tiny" and row["ttt_steps"] == 3
    # the real Trainer's micro-step: at most the one read of the non-finite guard, as tests/train/test_host_syncs.py
    assert row["host_syncs_per_micro_step"] <= 2, row["host_sync_ops"]
    assert row["bf16_vs_fp32_loss_rel"] < 2e-2  # the same batch under bf16 autocast and in fp32
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / statistics.median(row["step_s"]))  # timed steps
    assert row["loss_finite"] and row["losses"][-1] < row["losses"][0]  # the optimizer stepped
    # MFU divides by the plan's model FLOPs: they are the step's, as PyTorch counts them, within 10% (attention,
    # which the counter does not see on the CPU, and the positions past a document's end that no head reads)
    script = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "gpu_check" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(script)
    script.loader.exec_module(gpu_check)
    counted = counted_step_flops(gpu_check, row["tokens"], row["documents"])
    assert row["model_tflop_per_step"] * 1e12 == pytest.approx(counted, rel=0.10), (row["model_tflop_per_step"],
                                                                                    counted / 1e12)
    # the step's memory (the resident set's peak above its start) is what `eagle3-hf plan` predicts, within 50% at
    # this tiny shape (tests/train/test_plan.py holds the activation model to 15% at a larger one)
    assert 0.5 <= row["step_memory_measured_over_plan"] <= 1.5, row
    spec = report["extract_speculative"]
    assert spec["lossless_ok"] and set(spec["lossless"]) <= {"match", "tie"}
    assert spec["last_loss"] < spec["first_loss"] / 2  # the drafter learned from the extracted features
    assert spec["tokens_per_verifier_forward"] > 1.0  # and speculative decoding accepted some of its drafts
