"""`make llamacpp` (scripts/install_llamacpp.sh) as a user meets it without building anything: a machine without
cmake or a C++ compiler gets one line saying what to install, a finished build is found by its stamp and not
rebuilt (the PATH line printed), and the pin is the one eagle3-hf looks for."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

import pytest

from eagle3_hf.engines.llamacpp_env import LLAMACPP_PY_VERSION, STAMP

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install_llamacpp.sh"
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # the script's NATIVE_FLAGS on x86-64


def install(root: Path, path: str) -> subprocess.CompletedProcess:
    env = {"HOME": str(root.parent), "PATH": path, "EAGLE3_HF_LLAMACPP_DIR": str(root), "LLAMACPP_CUDA": "0"}
    return subprocess.run(["/bin/bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def test_no_cmake_is_one_line(tmp_path):
    bin_dir = tmp_path / "bin"  # the tools the script uses before building, and no cmake
    bin_dir.mkdir()
    for tool in ("cat", "grep", "sha256sum", "cut"):
        found = next((Path(d) / tool for d in os.environ["PATH"].split(":") if (Path(d) / tool).is_file()), None)
        if found:
            (bin_dir / tool).symlink_to(found)
    done = install(tmp_path / "build", str(bin_dir))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "error: make llamacpp needs cmake and a C++ compiler; `cmake` is not on PATH (e.g. apt-get install cmake g++)"]
    assert not (tmp_path / "build").exists()  # nothing downloaded or created


def finished_build(root: Path, cflags: str) -> Path:
    tree = root / f"llama_cpp_python-{LLAMACPP_PY_VERSION}" / "vendor" / "llama.cpp"
    server = tree / "build" / "bin" / "llama-server"
    server.parent.mkdir(parents=True)
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    spec = re.search(r"^SENTENCEPIECE_SPEC=(\S+)", SCRIPT.read_text(), re.M).group(1)
    (root / STAMP).write_text(f"llama-cpp-python=={LLAMACPP_PY_VERSION} cuda=0 {spec} cflags={cflags}\n")
    return server


def test_a_finished_build_is_not_rebuilt(tmp_path):
    root = tmp_path / "build"
    server = finished_build(root, NO_AMX if platform.machine() == "x86_64" else "")
    done = install(root, os.environ["PATH"])
    assert done.returncode == 0, done.stderr
    assert f"already built in {root}" in done.stdout
    assert f'export PATH="$PATH:{server.parent}"' in done.stdout


def test_a_build_with_amx_is_rebuilt(tmp_path):
    """A native build from before AMX was turned off (its stamp has no flags) is not taken as finished: ggml's AMX
    kernels died of an illegal instruction on a Xeon with AMX. Here the rebuild stops at the missing cmake."""
    if platform.machine() != "x86_64":
        pytest.skip("AMX is x86-64's")
    root = tmp_path / "build"
    server = finished_build(root, "")
    done = install(root, str(tmp_path / "no-tools"))
    assert done.returncode == 1 and "needs cmake" in done.stderr and "already built" not in done.stdout
    assert server.is_file()  # nothing removed before the build can start


def test_the_pin_is_the_one_eagle3_hf_looks_for():
    assert f"LLAMACPP_PY_VERSION={LLAMACPP_PY_VERSION}\n" in SCRIPT.read_text()
