"""vLLM's engine options: one shared group on every vLLM route, enforce_eager on the CPU only, replicas' GPUs by
LOCAL_RANK, and `serve-vllm --print-command` accepted by the installed vLLM's own server parser."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from eagle3_hf import cli
from eagle3_hf.engines import vllm_args
from eagle3_hf.engines.vllm_env import vllm_venv

VLLM_ROUTES = ("extract", "regenerate", "serve-features", "serve-vllm", "evaluate")
ENGINE_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
                "--enable-expert-parallel", "--gpu-memory-utilization", "--max-num-batched-tokens", "--max-model-len",
                "--vllm-device")


def test_every_vllm_route_has_the_one_group():
    for name in VLLM_ROUTES:
        parser = cli.command_parser(name)
        for flag in ENGINE_FLAGS:
            owners = [a for a in parser._actions if flag in a.option_strings]
            assert len(owners) == 1, (name, flag)


def test_llm_kwargs_and_server_flags():
    engine = {"tensor_parallel_size": 8, "pipeline_parallel_size": 1, "enable_expert_parallel": True,
              "gpu_memory_utilization": 0.85, "max_num_batched_tokens": None, "trust_remote_code": False}
    assert vllm_args.llm_kwargs(engine, cpu=False) == {"enforce_eager": False, "tensor_parallel_size": 8,
                                                       "enable_expert_parallel": True, "gpu_memory_utilization": 0.85}
    assert vllm_args.llm_kwargs({}, cpu=True) == {"enforce_eager": True}
    assert vllm_args.server_flags(engine, cpu=False) == ["--tensor-parallel-size", "8", "--enable-expert-parallel",
                                                         "--gpu-memory-utilization", "0.85"]
    assert vllm_args.server_flags({"trust_remote_code": True}, cpu=True) == ["--enforce-eager", "--trust-remote-code"]
    with pytest.raises(ValueError, match="one rank per replica"):
        vllm_args.check_offline({"data_parallel_size": 2})


def test_replicas_get_their_own_gpus():
    engine = {"tensor_parallel_size": 2, "device": "cuda"}
    env = {"WORLD_SIZE": "4", "LOCAL_RANK": "1"}
    assert vllm_args.replica_environment(engine, env) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    env["CUDA_VISIBLE_DEVICES"] = "7,6,5,4,3,2,1,0"
    assert vllm_args.replica_environment(engine, env) == {"CUDA_VISIBLE_DEVICES": "5,4"}
    assert vllm_args.replica_environment(engine, {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}) == {}
    with pytest.raises(ValueError, match="only 2 are visible"):
        vllm_args.instance_devices(1, 2, ["0", "1"])


# builds the server's parser as vllm/entrypoints/launchers/api_server/entry.py main() does, parses our command
PARSE = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
keys = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel",
        "gpu_memory_utilization", "max_num_batched_tokens", "max_model_len", "enforce_eager", "trust_remote_code",
        "enable_prefix_caching")
print(json.dumps({k: getattr(args, k) for k in keys}))
"""


def test_print_command_is_what_vllm_parses(tiny_verifier_dir, capsys):
    argv = ["serve-vllm", "--verifier", str(tiny_verifier_dir), "--tensor-parallel-size", "8",
            "--enable-expert-parallel", "--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "16384",
            "--max-model-len", "8192", "--vllm-device", "cuda", "--trust-remote-code", "--print-command"]
    assert cli.main(argv) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    words = shlex.split(command)
    server = words[words.index("-m") + 2:]  # after `python -m vllm.entrypoints.openai.api_server`
    assert "--enforce-eager" not in server and "--tensor-parallel-size" in server
    assert json.loads(server[server.index("--kv-transfer-config") + 1])["kv_connector"] == \
        "ExampleHiddenStatesConnector"  # vLLM's stock connector on CUDA
    python = vllm_venv() / "bin" / "python"
    if not python.is_file():
        pytest.skip("vLLM is not installed (`make vllm`): the command's options are checked against its parser there")
    out = subprocess.run([str(python), "-c", PARSE, json.dumps(server)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed == {"tensor_parallel_size": 8, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                      "enable_expert_parallel": True, "gpu_memory_utilization": 0.85, "max_num_batched_tokens": 16384,
                      "max_model_len": 8192, "enforce_eager": False, "trust_remote_code": True,
                      "enable_prefix_caching": False}
