"""Whether the tests that serve in vLLM run here: `make test` installs vLLM (`make vllm`, cached outside the
clone), so a missing install fails those tests, loudly; EAGLE3_HF_SKIP_VLLM=1 skips them (locally only, never in
CI: `make test` with it set does not install vLLM either)."""

from __future__ import annotations

import os

import pytest

from eagle3_hf.engines.vllm.vllm_env import STAMP, vllm_venv

from tests.helpers.warm import Started, start_warm_process, stop_warm_process


def skipping_vllm() -> bool:
    return os.environ.get("EAGLE3_HF_SKIP_VLLM", "").strip() not in ("", "0")


def vllm_or_fail() -> None:
    """Skip when EAGLE3_HF_SKIP_VLLM is set; fail, saying how to install it, when vLLM is not installed."""
    if skipping_vllm():
        pytest.skip("EAGLE3_HF_SKIP_VLLM is set: the tests that serve in vLLM do not run")
    if not (vllm_venv() / STAMP).is_file():
        pytest.fail(f"vLLM is not installed in {vllm_venv()}: run `make vllm` (or set EAGLE3_HF_SKIP_VLLM=1 locally)")


COLD_ENV = "EAGLE3_HF_TEST_COLD_VLLM"  # 1: every runner a fresh process (to measure what the warm one saves)


def start_warm_vllm() -> Started | None:
    """The session's warm vLLM process (engines/vllm/warm_launch.py), when vLLM is installed and not skipped: every
    vLLM runner the tests start (here or in a CLI subprocess, which inherits the variable) forks from it. It
    imports vLLM while the first tests run; a runner that starts before it listens is a fresh process."""
    from eagle3_hf.engines.vllm.vllm_env import vllm_environment, vllm_python
    from eagle3_hf.engines.vllm.warm_launch import WARM_ENV, start_warm

    if skipping_vllm() or os.environ.get(COLD_ENV, "").strip() not in ("", "0"):
        return None
    if not (vllm_venv() / STAMP).is_file() or os.environ.get(WARM_ENV):
        return None
    environment = vllm_environment(vllm_venv(), 1, offline=True)
    return start_warm_process(lambda path, log: start_warm(vllm_python(), environment, path, log), WARM_ENV)


def stop_warm_vllm(started: Started | None) -> None:
    from eagle3_hf.engines.vllm.warm_launch import WARM_ENV

    stop_warm_process(started, WARM_ENV)
