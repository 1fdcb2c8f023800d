"""Whether the tests that serve in vLLM run here: `make test` installs vLLM (`make vllm`, cached outside the
clone), so a missing install fails those tests, loudly; EAGLE3_HF_SKIP_VLLM=1 skips them (locally only, never in
CI: `make test` with it set does not install vLLM either)."""

from __future__ import annotations

import os

import pytest

from eagle3_hf.engines.vllm_env import STAMP, vllm_venv


def skipping_vllm() -> bool:
    return os.environ.get("EAGLE3_HF_SKIP_VLLM", "").strip() not in ("", "0")


def vllm_or_fail() -> None:
    """Skip when EAGLE3_HF_SKIP_VLLM is set; fail, saying how to install it, when vLLM is not installed."""
    if skipping_vllm():
        pytest.skip("EAGLE3_HF_SKIP_VLLM is set: the tests that serve in vLLM do not run")
    if not (vllm_venv() / STAMP).is_file():
        pytest.fail(f"vLLM is not installed in {vllm_venv()}: run `make vllm` (or set EAGLE3_HF_SKIP_VLLM=1 locally)")
