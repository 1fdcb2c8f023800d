"""vLLM's engine arguments, one set for every vLLM route: the argparse group the commands share (`extract --engine
vllm`, `regenerate --engine vllm`, `evaluate --engine vllm`, `serve-features`, `serve-vllm`), the request's
"engine" dict, and how it becomes `vllm.LLM(...)` keyword arguments (the runners, in vLLM's venv) or the OpenAI
server's flags (`serve-vllm`).

Standard library only: the runners import it by path inside vLLM's venv. The names are vLLM's own (its
`EngineArgs`, vllm/engine/arg_utils.py; the server's parser, vllm/entrypoints/openai/cli_args.py adds them through
`AsyncEngineArgs.add_cli_args`). `enforce_eager` (no CUDA graphs, no compilation) only on the CPU backend, where
the project's tests run; on a GPU vLLM captures its graphs as it does when users serve.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

# request key -> (server flag, default); a value equal to its default is left to vLLM
ENGINE_OPTIONS: dict[str, tuple[str, Any]] = {
    "tensor_parallel_size": ("--tensor-parallel-size", 1),
    "pipeline_parallel_size": ("--pipeline-parallel-size", 1),
    "data_parallel_size": ("--data-parallel-size", 1),
    "enable_expert_parallel": ("--enable-expert-parallel", False),
    "gpu_memory_utilization": ("--gpu-memory-utilization", None),
    "max_num_batched_tokens": ("--max-num-batched-tokens", None),
    "attention_backend": ("--attention-backend", None),
    "trust_remote_code": ("--trust-remote-code", False),
}
DEVICES = ("auto", "cuda", "cpu")


def gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU (nvidia-smi lists one): vLLM's CUDA build, not our venv's torch,
    decides where vLLM runs, so this is asked of the machine, as scripts/install_vllm.sh does."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def on_cpu(device: str = "auto") -> bool:
    """--vllm-device: "cpu", "cuda", or "auto" (by `gpu_present`)."""
    return device == "cpu" or (device == "auto" and not gpu_present())


def add_engine_arguments(parser: argparse.ArgumentParser, title: str | None = None) -> argparse._ArgumentGroup:
    """The one group of vLLM engine options (module docstring); every vLLM route adds it once."""
    group = parser.add_argument_group(title or "vLLM engine (passed to vLLM as named; vllm/engine/arg_utils.py)")
    group.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per layer (vLLM's TP)")
    group.add_argument("--pipeline-parallel-size", type=int, default=1, help="pipeline stages (vLLM's PP)")
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="vLLM's data-parallel engines (serve-vllm: vLLM's own server); offline extraction runs "
                            "one rank per replica instead (torchrun; each rank's vLLM gets its GPUs by LOCAL_RANK)")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE experts spread over the TP x DP GPUs (DeepSeek-V3, Kimi-K2)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="fraction of each GPU vLLM may take (vLLM's default 0.9; leave room for the verifier's "
                            "head, 2.3 GB for Kimi-K2.5, which this process keeps on its GPU)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens per engine step (vLLM's default by GPU; extraction prefills each sample in one "
                            "step, chunked prefill off, so it must be at least --max-model-len)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="vLLM's context length (default: what the samples need offline: the longest sample "
                            "+ 1, or the longest conversation + answers; evaluate: the longest prompt + "
                            "--max-new-tokens + --k + 1; a server: the verifier's max_position_embeddings). "
                            "`extract` (either --engine) takes samples of at most this - 1 tokens (one position is "
                            "the generated token) and skips and counts longer ones")
    group.add_argument("--attention-backend", default=None, metavar="NAME",
                       help="vLLM's attention backend by its name (default: vLLM's choice for the model and device); "
                            "e.g. CPU_MLA for a DeepSeek-V3/Kimi verifier in float32 on a CPU with AMX, where vLLM "
                            "picks AMX_MLA, which takes bf16 or fp16 weights only")
    group.add_argument("--vllm-device", choices=DEVICES, default="auto",
                       help="where vLLM runs: cuda (CUDA graphs, stock connector), cpu (enforce_eager, the project's "
                            "connector), auto: cuda when nvidia-smi lists a GPU here")
    return group


def add_run_arguments(group: argparse._ArgumentGroup, unit: str, timeout_note: str = "") -> None:
    """The knobs of a vLLM run this process drives (extract, regenerate): `unit`s per call, the stall limit, CPU
    threads."""
    group.add_argument("--vllm-batch-size", type=int, default=8, help=f"{unit} per vLLM call")
    group.add_argument("--vllm-max-pending", type=int, default=None, metavar="N",
                       help="files vLLM may have written and the readers not yet taken before it starts its next "
                            "batch (default 2 x --vllm-batch-size; each file is one sample's [tokens, 4, hidden] "
                            "states: the temporary disk peaks near N + batch files)")
    group.add_argument("--vllm-readers", type=int, default=None, metavar="N",
                       help="threads that read, check, map and checksum vLLM's files into shards (default min(4, "
                            "CPUs); `eagle3-hf plan` says how many a node's engines need)")
    group.add_argument("--vllm-timeout", type=float, default=None,
                       help="seconds vLLM may go without finishing a batch, model load included, before it is "
                            f"stopped (default $EAGLE3_HF_VLLM_TIMEOUT_S or 4 h){timeout_note}")
    group.add_argument("--threads", type=int, default=1, help="vLLM's CPU threads")


def check_run_arguments(args: argparse.Namespace) -> None:
    """One line for a run knob out of range (argparse's types take any int)."""
    for flag, least in (("vllm_batch_size", 1), ("vllm_readers", 1), ("vllm_max_pending", 0)):
        value = getattr(args, flag, None)
        if value is not None and value < least:
            raise ValueError(f"--{flag.replace('_', '-')} {value}: must be at least {least}")


def engine_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The request's "engine" dict from parsed options (trust_remote_code from the command's own flag)."""
    engine = {key: getattr(args, key, default) for key, (_flag, default) in ENGINE_OPTIONS.items()}
    engine["device"] = getattr(args, "vllm_device", "auto")
    return engine


def check_offline(engine: dict[str, Any]) -> None:
    """Offline routes (vllm.LLM in a runner) start one engine per rank: data parallelism is ranks, not an option."""
    if int(engine.get("data_parallel_size") or 1) > 1:
        raise ValueError("--data-parallel-size is for vLLM's own server (serve-vllm): elsewhere, launch one "
                         "rank per replica (torchrun --nproc-per-node R eagle3-hf extract ...; each rank's vLLM gets "
                         "its GPUs from LOCAL_RANK)")


def check_batched_tokens(engine: dict[str, Any], max_model_len: int) -> None:
    """Extraction runs vLLM with chunked prefill off (every sample's prefill whole, in one step), where vLLM takes a
    prompt only if one step holds it: --max-num-batched-tokens below the context is refused here, in one line,
    before vLLM starts (vLLM's own SchedulerConfig check would refuse it after the launch)."""
    tokens = engine.get("max_num_batched_tokens")
    if tokens is not None and int(tokens) < int(max_model_len):
        raise ValueError(f"--max-num-batched-tokens {tokens} is below vLLM's context of {max_model_len} tokens "
                         "(--max-model-len, else the longest sample + 1): extraction prefills each sample in one "
                         "step (chunked prefill off), so it must be at least that; raise it or lower --max-model-len")


def llm_kwargs(engine: dict[str, Any], cpu: bool) -> dict[str, Any]:
    """`vllm.LLM(**kwargs)` for the engine dict: every option set away from its default, enforce_eager on the CPU."""
    out: dict[str, Any] = {"enforce_eager": bool(cpu)}
    for key, (_flag, default) in ENGINE_OPTIONS.items():
        value = engine.get(key, default)
        if value is not None and value != default:
            out[key] = value
    return out


def server_flags(engine: dict[str, Any], cpu: bool) -> list[str]:
    """The OpenAI server's flags for the engine dict (`--enforce-eager` on the CPU only)."""
    flags = ["--enforce-eager"] if cpu else []
    for key, (flag, default) in ENGINE_OPTIONS.items():
        value = engine.get(key, default)
        if value is None or value == default:
            continue
        flags += [flag] if isinstance(value, bool) else [flag, str(value)]
    return flags


def instance_devices(local_rank: int, per_instance: int, visible: Sequence[str] | None = None) -> str:
    """CUDA_VISIBLE_DEVICES of this rank's vLLM when ranks run replicas side by side on one node: GPUs
    [r * per, (r + 1) * per) of those visible (default 0..)."""
    first = local_rank * per_instance
    ids = [str(i) for i in range(first, first + per_instance)] if visible is None else \
        list(visible)[first:first + per_instance]
    if len(ids) < per_instance:
        raise ValueError(f"rank {local_rank} needs GPUs {first}..{first + per_instance - 1} (TP x PP = {per_instance} "
                         f"per replica) but only {len(visible or [])} are visible")
    return ",".join(ids)


def replica_environment(engine: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, str]:
    """Env additions for this rank's vLLM when WORLD_SIZE > 1 ranks share a node: its own TP x PP GPUs by LOCAL_RANK,
    taken from CUDA_VISIBLE_DEVICES where the user set it."""
    env = dict(os.environ if env is None else env)
    if int(env.get("WORLD_SIZE", "1") or 1) <= 1 or "LOCAL_RANK" not in env or on_cpu(engine.get("device", "auto")):
        return {}
    per = int(engine.get("tensor_parallel_size") or 1) * int(engine.get("pipeline_parallel_size") or 1)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return {"CUDA_VISIBLE_DEVICES": instance_devices(int(env["LOCAL_RANK"]), per,
                                                     visible.split(",") if visible else None)}
