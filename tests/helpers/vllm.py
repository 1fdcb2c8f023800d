"""Whether the tests that serve in vLLM run here: `make test` installs vLLM (`make vllm`, cached outside the
clone), so a missing install fails those tests, loudly; EAGLE3_HF_SKIP_VLLM=1 skips them (locally only, never in
CI: `make test` with it set does not install vLLM either)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Any

import pytest

from eagle3_hf.engines.vllm.vllm_env import STAMP, vllm_venv


def skipping_vllm() -> bool:
    return os.environ.get("EAGLE3_HF_SKIP_VLLM", "").strip() not in ("", "0")


def vllm_or_fail() -> None:
    """Skip when EAGLE3_HF_SKIP_VLLM is set; fail, saying how to install it, when vLLM is not installed."""
    if skipping_vllm():
        pytest.skip("EAGLE3_HF_SKIP_VLLM is set: the tests that serve in vLLM do not run")
    if not (vllm_venv() / STAMP).is_file():
        pytest.fail(f"vLLM is not installed in {vllm_venv()}: run `make vllm` (or set EAGLE3_HF_SKIP_VLLM=1 locally)")


COLD_ENV = "EAGLE3_HF_TEST_COLD_VLLM"  # 1: every runner a fresh process (to measure what the warm one saves)


def start_warm_vllm() -> tuple[Any, str] | None:
    """The session's warm vLLM process (engines/vllm/warm_launch.py), when vLLM is installed and not skipped: every
    vLLM runner the tests start (here or in a CLI subprocess, which inherits the variable) forks from it. It
    imports vLLM while the first tests run; a runner that starts before it listens is a fresh process."""
    from eagle3_hf.engines.vllm.vllm_env import vllm_environment, vllm_python
    from eagle3_hf.engines.vllm.warm_launch import WARM_ENV, start_warm

    if skipping_vllm() or os.environ.get(COLD_ENV, "").strip() not in ("", "0"):
        return None
    if not (vllm_venv() / STAMP).is_file() or os.environ.get(WARM_ENV):
        return None
    folder = tempfile.mkdtemp(prefix="eagle3_warm_")  # short: a Unix socket's path has at most 107 bytes
    path = os.path.join(folder, "vllm.sock")
    with open(os.path.join(folder, "warm.log"), "w", encoding="utf-8") as log:
        proc = start_warm(vllm_python(), vllm_environment(vllm_venv(), 1, offline=True), path, log)
    os.environ[WARM_ENV] = path
    return proc, folder


def stop_warm_vllm(started: tuple[Any, str] | None) -> None:
    from eagle3_hf.engines.vllm.warm_launch import WARM_ENV

    if started is None:
        return
    proc, folder = started
    os.environ.pop(WARM_ENV, None)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if os.environ.get("EAGLE3_HF_TEST_WARM_LOG"):
        shutil.copy(os.path.join(folder, "warm.log"), os.environ["EAGLE3_HF_TEST_WARM_LOG"])
    shutil.rmtree(folder, ignore_errors=True)
