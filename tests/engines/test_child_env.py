"""What an engine child started from a torchrun rank inherits: the user's settings, never the launcher's rank
variables. The children here are real processes started the way each route starts vLLM, with a stand-in venv whose
python records its environment instead of running vLLM."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_hf.engines.child_env import LAUNCHER_VARIABLES, engine_environment, launcher_variable
from eagle3_hf.engines.vllm.vllm_env import STAMP, VllmError, VllmExtraction, run_vllm, vllm_environment
from eagle3_hf.engines.vllm.vllm_request import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
# what `torchrun --nnodes 2 --nproc-per-node 8` gives rank 9 (the second node's second process)
TORCHRUN = {"RANK": "9", "LOCAL_RANK": "1", "GROUP_RANK": "1", "ROLE_RANK": "9", "ROLE_NAME": "default",
            "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "16",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x/error.json"}
USER = {"HF_HUB_OFFLINE": "1", "HF_HOME": "/data/hf", "HF_TOKEN": "hf_secret", "NCCL_IB_HCA": "mlx5",
        "TOKENIZERS_PARALLELISM": "true", "PYTHONWARNINGS": "default", "VLLM_CPU_KVCACHE_SPACE": "4"}


def test_the_launcher_list_is_what_torchrun_sets_each_worker():
    """Read from torch's elastic agent at test time: a variable torch adds later fails this test, not a node."""
    import inspect
    import re

    from torch.distributed.elastic.agent.server import local_elastic_agent

    source = inspect.getsource(local_elastic_agent.LocalElasticAgent._start_workers)

    set_by_torch = set(re.findall(r'"([A-Z][A-Z_]+)": ', source)) | {"LOCAL_RANK"}
    kept_on_purpose = {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}  # torchrun passes the user's own value through
    assert {v for v in set_by_torch - kept_on_purpose if not launcher_variable(v)} == set()
    assert all(launcher_variable(v) for v in TORCHRUN)


def test_the_engine_environment_drops_the_launchers_variables_and_keeps_the_users():
    env = engine_environment({**TORCHRUN, **USER, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert env == {**USER, "CUDA_VISIBLE_DEVICES": "0,1"}
    assert not set(env) & LAUNCHER_VARIABLES


@pytest.mark.parametrize("user, offline, child", [
    ("1", False, "1"),  # a repo id with the user offline: the child reads the cache too
    ("1", True, "1"),
    (None, True, "1"),  # local paths only: the child needs no Hub
    (None, False, None),  # a repo id, nothing set: the Hub as usual
    ("0", False, "0"),
])
def test_hf_hub_offline_is_the_users(monkeypatch, tmp_path, user, offline, child):
    if user is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", user)
    assert vllm_environment(tmp_path, 1, offline).get("HF_HUB_OFFLINE") == child


@pytest.fixture
def recording_venv(tmp_path, monkeypatch):
    """A vLLM venv whose python writes its environment to $ENV_DUMP and exits: the child as started."""
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, os; "
                      "json.dump(dict(os.environ), open(os.environ[\"ENV_DUMP\"], \"w\"))'\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    (venv / STAMP).write_text("test")
    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(venv))
    dump = tmp_path / "env.json"
    monkeypatch.setenv("ENV_DUMP", str(dump))
    for name, value in {**TORCHRUN, **USER}.items():
        monkeypatch.setenv(name, value)
    return dump


def test_a_runner_started_from_a_torchrun_rank_gets_no_rank_variables(recording_venv, tiny_verifier_dir):
    """`evaluate --engine vllm`'s runner (run_vllm) and `extract --engine vllm`'s (VllmExtraction), with a repo id
    (so not offline by our choice): the user's settings as they were, none of torchrun's."""
    with pytest.raises(VllmError, match="ended without a result"):
        run_vllm(GenerationRequest(verifier="org/not-a-local-path", prompts=[]))
    child = json.loads(recording_venv.read_text())
    assert not [k for k in child if launcher_variable(k)]
    assert {k: child.get(k) for k in USER} == USER

    recording_venv.unlink()
    with pytest.raises(VllmError, match="ended without a result"):
        with VllmExtraction({"verifier": "org/not-a-local-path", "engine": {}}, [(0, [1, 2])], timeout=60) as run:
            list(run.records())
    child = json.loads(recording_venv.read_text())
    assert not [k for k in child if launcher_variable(k)]
    assert {k: child.get(k) for k in USER} == USER


def test_the_openai_servers_command_gets_no_rank_variables(recording_venv, tmp_path):
    from eagle3_hf.engines.vllm.vllm_openai import VllmOpenAIServer

    server = VllmOpenAIServer("org/verifier", [1, 2, 3, 4], port=8000, storage=tmp_path / "s",
                              engine={"device": "cpu"})
    server.storage = tmp_path / "s"
    _argv, env = server.command()
    assert not [k for k in env if launcher_variable(k)]
    assert {k: env.get(k) for k in USER} == USER


def test_the_same_under_torchrun_itself(recording_venv, tmp_path, monkeypatch):
    """Two ranks of a real `torchrun` each start a runner: neither child sees RANK, WORLD_SIZE, MASTER_PORT."""
    for name in TORCHRUN:
        monkeypatch.delenv(name)
    script = tmp_path / "rank.py"
    script.write_text("import os\nfrom eagle3_hf.engines.vllm.vllm_env import run_vllm\n"
                      "from eagle3_hf.engines.vllm.vllm_request import GenerationRequest\n"
                      "os.environ['ENV_DUMP'] += os.environ['RANK']\n"
                      "try:\n    run_vllm(GenerationRequest(verifier='org/x', prompts=[]))\n"
                      "except Exception:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for rank in (0, 1):
        child = json.loads(recording_venv.with_name(recording_venv.name + str(rank)).read_text())
        assert not [k for k in child if launcher_variable(k)], rank
        assert child["HF_HUB_OFFLINE"] == "1" and child["NCCL_IB_HCA"] == "mlx5"
