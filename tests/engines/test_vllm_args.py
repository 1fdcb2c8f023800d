"""vLLM's engine options: one shared group on every vLLM route, enforce_eager on the CPU only, replicas' GPUs by
LOCAL_RANK, and `serve-vllm --print-command` accepted by the installed vLLM's own server parser."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from eagle3_hf import cli
from eagle3_hf.engines.vllm import vllm_args
from eagle3_hf.engines.vllm.vllm_env import vllm_venv

VLLM_ROUTES = ("extract", "regenerate", "serve-features", "serve-vllm", "evaluate")
ENGINE_FLAGS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size",
                "--enable-expert-parallel", "--gpu-memory-utilization", "--max-num-batched-tokens", "--max-model-len",
                "--attention-backend", "--vllm-device")


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
    assert vllm_args.llm_kwargs({"attention_backend": "CPU_MLA"}, cpu=True) == {"enforce_eager": True,
                                                                                "attention_backend": "CPU_MLA"}
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
        "enable_prefix_caching", "attention_backend")
print(json.dumps({k: getattr(args, k) for k in keys}))
"""


def test_print_command_is_what_vllm_parses(tiny_verifier_dir, capsys):
    argv = ["serve-vllm", "--verifier", str(tiny_verifier_dir), "--tensor-parallel-size", "8",
            "--enable-expert-parallel", "--gpu-memory-utilization", "0.85", "--max-num-batched-tokens", "16384",
            "--max-model-len", "8192", "--attention-backend", "FLASHMLA", "--vllm-device", "cuda",
            "--trust-remote-code", "--print-command"]
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
                      "enable_prefix_caching": False, "attention_backend": "FLASHMLA"}


def test_max_num_batched_tokens_below_the_context_is_one_line_before_vllm_starts():
    """Chunked prefill is off on every extraction route: vLLM needs one step to hold the whole context."""
    vllm_args.check_batched_tokens({"max_num_batched_tokens": 4096}, 4096)
    vllm_args.check_batched_tokens({}, 1 << 20)  # unset: vLLM raises its default to the context itself
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens 2048 is below vLLM's context of 4096 tokens"):
        vllm_args.check_batched_tokens({"max_num_batched_tokens": 2048}, 4096)


@pytest.mark.parametrize("command", ["serve-vllm", "extract"])
def test_each_extraction_route_refuses_too_few_batched_tokens(command, tiny_verifier_dir, tmp_path, capsys):
    argv = [command, "--verifier", str(tiny_verifier_dir), "--max-num-batched-tokens", "1024", "--max-model-len",
            "4096", "--vllm-device", "cpu"]
    extract = ["--engine", "vllm", "--data", str(tmp_path / "prepared"), "--output", str(tmp_path / "o")]
    argv += ["--print-command"] if command == "serve-vllm" else extract
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-num-batched-tokens 1024 is below vLLM's context of 4096 tokens" in err[0], err
    assert not (tmp_path / "o").exists()


def test_the_offline_request_is_checked_against_the_longest_sample():
    """Without --max-model-len the context is the longest sample + 1, known once the samples are read."""
    from eagle3_hf.features.vllm.vllm_spec import VllmFeatureSpec

    spec = VllmFeatureSpec.__new__(VllmFeatureSpec)  # only `request` is exercised: no verifier needed
    spec.path, spec.revision, spec.vllm_dtype, spec.layer_ids = "v", None, "bfloat16", [1, 2, 3, 4]
    assert spec.request(2049, engine={"max_num_batched_tokens": 4096})["engine"]["max_num_batched_tokens"] == 4096
    with pytest.raises(ValueError, match="below vLLM's context of 2049"):
        spec.request(2049, engine={"max_num_batched_tokens": 2048})


def test_the_feature_servers_request_is_checked(tiny_verifier_dir):
    from eagle3_hf.features.commands.serve_features import ServerSettings, server_request
    from eagle3_hf.features.vllm.vllm_spec import VllmOptions

    ok = server_request(ServerSettings(str(tiny_verifier_dir), vllm=VllmOptions(
        max_model_len=512, engine={"max_num_batched_tokens": 512})))
    assert ok["engine"]["max_num_batched_tokens"] == 512 and ok["max_model_len"] == 512
    with pytest.raises(ValueError, match="below vLLM's context of 2048"):  # the verifier's max_position_embeddings
        server_request(ServerSettings(str(tiny_verifier_dir),
                                      vllm=VllmOptions(engine={"max_num_batched_tokens": 1024})))
