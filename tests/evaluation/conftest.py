"""Fixtures of the `evaluate --engine vllm` tests: the served pair (a verifier vLLM serves, a drafter trained for
it), one real `evaluate --engine vllm` of it shared by the slow tests that each check a part of that run, and a
vLLM venv whose python is ours, enough to reach the checks that precede vLLM itself."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3_hf.engines.vllm.vllm_env import STAMP

from tests.helpers.served_pair import VLLM_EVALUATION_ARGS, chain_verifier, trained_drafter


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


@dataclass(frozen=True)
class VllmEvaluation:
    """One `evaluate --engine vllm` of the served pair (`vllm_evaluation`): its stdout, the vLLM and transformers
    summaries, the repo id the drafter was pulled by and the empty HF cache it was pulled into."""

    stdout: str
    served: dict
    ours: dict
    repo_id: str
    hf_home: Path


@pytest.fixture(scope="session")
def vllm_evaluation(served_pair, tmp_path_factory) -> VllmEvaluation:
    """The served pair's drafter pushed by `eagle3-hf push` to a loopback Hub, then `evaluate --engine vllm
    --drafter REPO_ID`: vLLM's CPU build and our decoder each download it by repo id into an empty cache
    (HF_HUB_OFFLINE=0 for that process only; the verifier stays a local path), both vLLM engines in one process.
    Run once for the session (its users are one xdist group: tests/helpers/xdist_groups.py): serving like our
    decoder, loading by repo id, and one engine at a time against both together are three readings of one run."""
    from tests.helpers.hub_server import READ_TOKEN, TEST_ORGS, TEST_TOKENS, WRITE_TOKEN, HubServer
    from tests.helpers.vllm import vllm_or_fail

    vllm_or_fail()
    verifier, drafter = served_pair
    root = tmp_path_factory.mktemp("vllm_evaluation")
    eagle3_hf, repo_id = str(Path(sys.executable).parent / "eagle3-hf"), "tester/chain-eagle3"
    cwd = Path(__file__).resolve().parents[2]
    with HubServer(root / "hub", orgs=TEST_ORGS, tokens=TEST_TOKENS) as hub:
        pushed = subprocess.run([eagle3_hf, "push", str(drafter), "--repo-id", repo_id], cwd=cwd,
                                env=hub.client_env(WRITE_TOKEN), capture_output=True, text=True, timeout=300)
        assert pushed.returncode == 0, pushed.stdout[-2000:] + pushed.stderr[-2000:]
        env = dict(hub.client_env(READ_TOKEN), HF_HOME=str(root / "hf"), OMP_NUM_THREADS="1")
        result = subprocess.run([eagle3_hf, "evaluate", "--engine", "vllm", "--drafter", repo_id, "--verifier",
                                 str(verifier), *VLLM_EVALUATION_ARGS, "--vllm-engines", "together", "--no-progress",
                                 "--output", str(root / "eval")], cwd=cwd, env=env, capture_output=True, text=True,
                                timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return VllmEvaluation(result.stdout, json.loads((root / "eval" / "eagle3_evaluation_vllm.json").read_text()),
                          json.loads((root / "eval" / "eagle3_evaluation.json").read_text()), repo_id, root / "hf")


@pytest.fixture
def fake_vllm_venv(tmp_path, monkeypatch):
    """A venv whose python is ours (no vllm inside): enough to reach the checks that precede vLLM itself."""
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / STAMP).write_text("test")
    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(venv))
    return venv
