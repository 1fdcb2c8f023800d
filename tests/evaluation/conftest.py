"""Fixtures of the `evaluate --engine vllm` tests: the served pair (a verifier vLLM serves, a drafter trained for
it) and a vLLM venv whose python is ours, enough to reach the checks that precede vLLM itself."""

from __future__ import annotations

import sys

import pytest

from eagle3_hf.engines.vllm_env import STAMP

from tests.helpers.served_pair import chain_verifier, trained_drafter


@pytest.fixture(scope="session")
def served_pair(tmp_path_factory, tokenizer):
    """(verifier dir with the SmolLM2 tokenizer, trained drafter dir in the standard layout): trained once for the
    session, its users in one xdist group (tests/conftest.py SHARED_FIXTURES). Read-only to them."""
    root = tmp_path_factory.mktemp("vllm_pair")
    verifier = chain_verifier()
    verifier.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    drafter = trained_drafter(verifier)
    drafter.save_pretrained(root / "drafter")
    return root / "verifier", root / "drafter"


@pytest.fixture
def fake_vllm_venv(tmp_path, monkeypatch):
    """A venv whose python is ours (no vllm inside): enough to reach the checks that precede vLLM itself."""
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / STAMP).write_text("test")
    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(venv))
    return venv
