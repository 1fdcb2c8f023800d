"""examples/train.py is the training script and `eagle3-hf train` runs it: `--help` is the first thing a
user types, and it must list every argument group (model, data, TrainingArguments with TTT) and exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# one flag of each argument group: model, data, TTT, transformers' TrainingArguments, the --config file
FLAGS = ["--finetune-from", "--data-dir", "--online", "--ttt-step-weight", "--learning-rate", "--output-dir",
         "--config"]


@pytest.mark.parametrize("command", [[str(ROOT / "examples" / "train.py")], ["-m", "eagle3_hf.cli", "train"]],
                         ids=["examples/train.py", "eagle3-hf train"])
def test_help_lists_every_argument_and_exits_0(command):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    missing = [flag for flag in FLAGS if flag not in result.stdout]
    assert not missing, f"--help does not list {missing}"


def test_the_cli_runs_the_example_script():
    from eagle3_hf import training

    assert training.TRAINING_SCRIPT == ROOT / "examples" / "train.py"
    assert training.training_script().__file__ == str(ROOT / "examples" / "train.py")
