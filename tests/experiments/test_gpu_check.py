"""gpu_check/gpu_check.sh's CPU path: the same code as on the GPU at a tiny shape, one JSON with every part passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    assert row["attn_implementation"] == "sdpa" and row["tokens_per_s"] > 0 and len(row["step_s"]) == 2
    assert row["loss_finite"] and row["losses"][-1] < row["losses"][0]  # the optimizer stepped
    assert row["plan_step_peak_gib"] > 0 and row["model_tflop_per_step"] > 0
    spec = report["extract_speculative"]
    assert spec["lossless_ok"] and set(spec["lossless"]) <= {"match", "tie"}
    assert spec["last_loss"] < spec["first_loss"] / 2  # the drafter learned from the extracted features
    assert spec["tokens_per_verifier_forward"] > 1.0  # and speculative decoding accepted some of its drafts
