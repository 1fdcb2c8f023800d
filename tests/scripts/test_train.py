"""The training script ships in the package (eagle3_hf/scripts/train.py): `eagle3-hf train` and
`accelerate launch examples/train.py` both run it, and it works from a wheel installed outside the repository.
`--help` is the first thing a user types: it must list every argument group and exit 0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers.data import COMMON

ROOT = Path(__file__).resolve().parents[2]
# one flag of each argument group: model, data, TTT, transformers' TrainingArguments, the --config file
FLAGS = ["--finetune-from", "--features", "--prepared-dir", "--ttt-step-weight", "--learning-rate", "--output-dir",
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


def test_the_cli_and_the_example_run_the_packaged_script(monkeypatch):
    """`eagle3-hf train ARGS` and `examples/train.py ARGS` (what `accelerate launch` runs) both hand ARGS, as given,
    to the packaged script's main; `train` keeps TrainingArguments' own `--debug`, which the CLI takes elsewhere."""
    import runpy

    from eagle3_hf import cli
    from eagle3_hf.scripts import train

    seen: list[list[str]] = []
    monkeypatch.setattr(train, "main", lambda argv=None: seen.append(list(argv)) or {})
    args = ["--features", "feats", "--output-dir", "out", "--debug", "underflow_overflow", "--max-steps", "1"]
    assert cli.main(["train", *args]) == 0
    monkeypatch.setattr(sys, "argv", [str(ROOT / "examples" / "train.py"), *args])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(ROOT / "examples" / "train.py"), run_name="__main__")
    assert done.value.code == 0
    assert seen == [args, args]


def _wheel_venv(where: Path) -> Path:
    """A fresh venv with `pip install .` (a built wheel, not editable) of this checkout. Its dependencies come
    from the test's own environment through a path entry, which (unlike a site dir) runs none of that
    environment's .pth files, so the repository's editable install cannot leak in."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    source = where.parent / "source"  # a copy: the build writes build/ and *.egg-info next to pyproject.toml
    shutil.copytree(ROOT / "eagle3_hf", source / "eagle3_hf", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", str(source)], check=True, timeout=600, cwd=where)
    return where


@pytest.mark.slow
def test_a_wheel_install_trains_from_outside_the_repository(tmp_path, synthetic):
    venv = _wheel_venv(tmp_path / "venv")
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import eagle3_hf; print(eagle3_hf.__file__)"],
                           capture_output=True, text=True, env=env, cwd=away, check=True).stdout.strip()
    assert where.startswith(str(venv)), f"eagle3_hf was imported from {where}, not from the installed wheel"

    cli = str(venv / "bin" / "eagle3-hf")
    help_run = subprocess.run([cli, "train", "--help"], capture_output=True, text=True, env=env, cwd=away, timeout=300)
    assert help_run.returncode == 0 and "--features" in help_run.stdout, help_run.stderr[-2000:]

    out = tmp_path / "drafter"
    run = subprocess.run([cli, "train", "--verifier", str(synthetic["verifier_dir"]), "--features",
                          str(synthetic["features"]), "--output-dir", str(out), "--max-steps", "2",
                          "--validation-fraction", "0.2", "--save-strategy", "no", "--eval-strategy", "no", *COMMON],
                         capture_output=True, text=True, env=env, cwd=away, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "eagle3_training.json").read_text())
    assert summary["log_history"][-1]["step"] == 2
    assert (out / "model.safetensors").is_file()
