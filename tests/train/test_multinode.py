"""Many machines, the way one machine can show it: accelerate_configs/multinode_zero3_template.yaml as written
(DeepSpeed ZeRO-3, standard launcher, static rendezvous), launched twice — machine_rank 0 and 1, two processes
each, head at 127.0.0.1 — over gloo on the CPU. The 2 x 2 run must train to the same losses and metrics as one
process with the same global batch (4 packed rows)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.data import COMMON

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "accelerate_configs/multinode_zero3_template.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def common_args(synthetic, out: Path, batch: int) -> list[str]:
    i = COMMON.index("--per-device-train-batch-size")
    args = COMMON[:i] + COMMON[i + 2:]
    return ["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
            "--output-dir", str(out), "--num-train-epochs", "3", "--validation-fraction", "0.2",
            "--logging-steps", "1", "--per-device-train-batch-size", str(batch), *args]


@pytest.mark.slow
@pytest.mark.timeout(600)  # 118 s measured (README, Development)
def test_two_machines_of_two_processes_train_like_one_process(synthetic, tmp_path):
    port, out = free_port(), tmp_path / "multinode"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    machines = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(TEMPLATE), "--num_processes", "4",
         "--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1",
         "--main_process_port", str(port), str(ROOT / "examples/train.py"), *common_args(synthetic, out, 1)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT) for rank in (0, 1)]
    logs = [m.communicate(timeout=900)[0] for m in machines]
    for rank, (m, log) in enumerate(zip(machines, logs)):
        assert m.returncode == 0, f"machine_rank {rank}:\n{log[-3000:]}"
    multi = json.loads((out / "eagle3_training.json").read_text())
    one = subprocess.run([sys.executable, str(ROOT / "examples/train.py"),
                          *common_args(synthetic, tmp_path / "single", 4)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert one.returncode == 0, one.stderr[-3000:]
    single = json.loads((tmp_path / "single" / "eagle3_training.json").read_text())

    def losses(summary: dict, key: str) -> list[tuple[int, float]]:
        return [(h["step"], h[key]) for h in summary["log_history"] if key in h]

    assert losses(multi, "loss") and len(losses(multi, "loss")) == len(losses(single, "loss"))
    for key in ("loss", "eval_loss", "eval_acc_0", "eval_simulated_acceptance_length"):
        got, want = losses(multi, key), losses(single, key)
        assert [s for s, _ in got] == [s for s, _ in want], key  # same optimizer steps: the same global batch
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5, abs=1e-6), key
    for key in ("step_accuracy", "step_conditional_accuracy"):
        assert multi["metrics"][key] == pytest.approx(single["metrics"][key], abs=1e-6), key
    assert multi["data"]["num_train_rows"] == single["data"]["num_train_rows"]
