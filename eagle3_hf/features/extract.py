"""`eagle3-hf extract`: run the verifier over a prepared dataset and write its features to shards.

The pipeline's offline mode (docs/contracts.md). One verifier forward per sample (no padding, so a sample's features
do not depend on its neighbours and a resumed run is bit-identical to an uninterrupted one). Under
`torchrun` / `accelerate launch` each rank takes samples i with i % world_size == rank, writes its own
shards and journal, and rank 0 merges all journals into manifest.json once every sample is accounted for.
Killed at any point, the same command resumes (see shards.py for why nothing is lost or duplicated).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..data.prepared_format import open_prepared, prepared_lengths
from ..verifier.capture import capture_features
from ..verifier.family import check_aux_indices, default_aux_indices, text_config
from .store import ShardWriter, canonical_dtype, dist_env, make_header, wait_and_merge

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedModel


def verifier_info(verifier: PreTrainedModel, name: str | None = None, revision: str | None = None) -> dict:
    config = text_config(verifier)
    name = name or getattr(verifier.config, "_name_or_path", None) or type(verifier).__name__
    return {"name": str(name), "revision": revision, "num_hidden_layers": int(config.num_hidden_layers),
            "hidden_size": int(config.hidden_size), "vocab_size": int(config.vocab_size)}


def extract_features(
    verifier: PreTrainedModel,
    tokenizer_fingerprint: str,
    prepared_dataset: datasets.Dataset | str | Path,
    out_dir: str | Path,
    aux_indices: Sequence[int] | None = None,
    dtype: str = "bfloat16",
    samples_per_shard: int = 64,
    max_shard_bytes: int = 1 << 30,
    verifier_name: str | None = None,
    verifier_revision: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    progress: bool = True,
    merge_timeout_s: float | None = 48 * 3600,
) -> dict[str, Any]:
    """Write features for this rank's slice of `prepared_dataset` to `out_dir`; returns a summary dict.

    Appending to a directory built with another verifier, tokenizer, aux layers or dtype is refused.
    """
    from tqdm.auto import tqdm

    env_rank, env_world = dist_env()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    out_dir = Path(out_dir)
    info = verifier_info(verifier, verifier_name, verifier_revision)
    indices = check_aux_indices(aux_indices or default_aux_indices(info["num_hidden_layers"]),
                                info["num_hidden_layers"])
    ds = open_prepared(prepared_dataset, tokenizer_fingerprint)
    header = make_header(info, tokenizer_fingerprint, indices, canonical_dtype(dtype))
    writer = ShardWriter(out_dir, header, rank=rank, samples_per_shard=samples_per_shard,
                         max_shard_bytes=max_shard_bytes)
    all_ids = list(ds["id"])
    todo = [i for i in range(rank, len(ds), world_size) if all_ids[i] not in writer.done_ids]
    lengths = prepared_lengths(ds)
    resumed = len(range(rank, len(ds), world_size)) - len(todo)
    bar = tqdm(total=int(sum(lengths[i] for i in todo)), unit="tok", unit_scale=True, desc=f"extract r{rank}",
               disable=not progress, dynamic_ncols=True)
    rows = ds.with_format("torch", columns=["input_ids", "loss_mask"])
    start = time.perf_counter()
    try:
        for i in todo:
            row = rows[i]
            sample_id = all_ids[i]
            input_ids = row["input_ids"].long()  # [T]
            if input_ids.numel() == 0:
                writer.skip(sample_id, "empty")
                continue
            feats = capture_features(verifier, input_ids, indices)
            writer.add(sample_id, input_ids, row["loss_mask"], feats["aux_hidden_states"],
                       feats["last_hidden_state"], feats["verifier_greedy"])
            bar.update(input_ids.numel())
            bar.set_postfix(skipped=sum(writer.skipped_counts.values()), refresh=False)
    finally:
        writer.close()
        bar.close()
    elapsed = time.perf_counter() - start
    summary = {"rank": rank, "world_size": world_size, "written_samples": writer.written_samples,
               "written_tokens": writer.written_tokens, "resumed_past": resumed,
               "skipped": dict(writer.skipped_counts), "seconds": round(elapsed, 3),
               "tokens_per_s": round(writer.written_tokens / elapsed, 1) if elapsed > 0 else None}
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    if rank == 0:
        manifest = wait_and_merge(out_dir, all_ids, merge_timeout_s)
        summary.update(total_samples=len(manifest["samples"]), total_skipped=manifest["skipped"])
    return summary


# ---------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="smollm2-135m-instruct", help="verifier name, Hub id or local path")
    parser.add_argument("--revision", default=None, help="verifier revision (Hub)")
    parser.add_argument("--data", required=True, help="prepared dataset directory (from `eagle3-hf prepare`)")
    parser.add_argument("--output", required=True, help="feature directory (created, or resumed/appended)")
    parser.add_argument("--aux-layers", default=None,
                        help="three output_hidden_states indices a,b,c in 1..N-1 (default 2,N//2,N-3)")
    parser.add_argument("--dtype", default="bf16", help="bf16 (default), fp8 (e4m3 + per-row scale) or fp32")
    parser.add_argument("--device-map", default=None,
                        help="auto (or balanced, sequential): shard a verifier too big for one device over the "
                             "devices of --max-memory, offloading the rest to --offload-folder; or a JSON map "
                             "(string or file) of module name -> device")
    parser.add_argument("--max-memory", default=None,
                        help="with --device-map: per-device budget, e.g. 0=70GiB,1=70GiB,cpu=200GiB")
    parser.add_argument("--offload-folder", default=None,
                        help="with --device-map: where weights that fit no device go (default: a temporary folder)")
    parser.add_argument("--device", default=None, help="device for the verifier (default cuda:LOCAL_RANK or cpu)")
    parser.add_argument("--torch-dtype", default="auto", help="verifier compute dtype (auto = checkpoint's)")
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--max-shard-mb", type=int, default=1024, help="a shard is closed at this size too")
    parser.add_argument("--no-progress", action="store_true")
    engine = parser.add_argument_group("--engine vllm (the serving engine computes the states; `make vllm`)")
    engine.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                        help="transformers: forward hooks in this process; vllm: vLLM's extract_hidden_states in "
                             "its own venv, then the verifier's final norm and lm_head here (default: %(default)s)")
    engine.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM's tensor parallelism")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="vLLM's context length (default: the longest sample + 1)")
    engine.add_argument("--vllm-batch-size", type=int, default=8, help="prompts per vLLM generate call")
    engine.add_argument("--vllm-timeout", type=float, default=None,
                        help="seconds vLLM may go without finishing a batch, model load included, before it is "
                             "stopped (default $EAGLE3_HF_VLLM_TIMEOUT_S or 4 h); with --endpoint, seconds per "
                             "request and its file (default 600)")
    engine.add_argument("--threads", type=int, default=1, help="vLLM's CPU threads")
    engine.add_argument("--endpoint", default=None, metavar="URL",
                        help="with --engine vllm: a running vLLM OpenAI server started with the extraction config "
                             "(`eagle3-hf serve-vllm`) computes the states, --vllm-batch-size requests at a time; "
                             "this machine must see its storage directory")
    engine.add_argument("--vllm-storage", default=None, metavar="DIR",
                        help="with --endpoint: the server's storage directory, the only place whose files are read "
                             "and deleted (default: the one `eagle3-hf serve-vllm` names)")


def run_vllm_engine(args: argparse.Namespace, aux: list[int] | None) -> int:
    """`extract --engine vllm`."""
    from ..data.fingerprint import tokenizer_fingerprint
    from ..verifier.loading import load_tokenizer
    from .vllm_offline import extract_features_vllm

    if args.device_map or args.max_memory or args.offload_folder or args.device:
        raise SystemExit("--engine vllm places the verifier itself: drop --device-map/--max-memory/--offload-folder/"
                         "--device (use --tensor-parallel-size)")
    fingerprint = tokenizer_fingerprint(load_tokenizer(args.verifier, revision=args.revision))
    summary = extract_features_vllm(args.verifier, fingerprint, args.data, args.output, aux_indices=aux,
                                    dtype=args.dtype, samples_per_shard=args.samples_per_shard,
                                    max_shard_bytes=args.max_shard_mb << 20, verifier_name=args.verifier,
                                    verifier_revision=args.revision, vllm_dtype=args.torch_dtype,
                                    max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
                                    batch_size=args.vllm_batch_size, threads=args.threads, timeout=args.vllm_timeout,
                                    endpoint=args.endpoint, vllm_storage=args.vllm_storage,
                                    debug=os.environ.get("EAGLE3_HF_DEBUG", "").strip() not in ("", "0"),
                                    progress=not args.no_progress)
    print(json.dumps(summary))
    return 0


def run(args: argparse.Namespace) -> int:
    from ..data.fingerprint import tokenizer_fingerprint
    from ..verifier.loading import load_tokenizer, load_verifier

    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
    if args.endpoint and args.engine != "vllm":
        raise SystemExit("--endpoint URL needs --engine vllm (a vLLM OpenAI server started by `eagle3-hf serve-vllm`)")
    if getattr(args, "engine", "transformers") == "vllm":
        return run_vllm_engine(args, aux)
    kwargs: dict[str, Any] = {"dtype": args.torch_dtype}
    if (args.max_memory or args.offload_folder) and not args.device_map:
        raise SystemExit("--max-memory and --offload-folder need --device-map")
    offload_tmp = None
    if args.device_map:
        kwargs["device_map"] = parse_device_map(args.device_map)
        if args.max_memory:
            kwargs["max_memory"] = parse_max_memory(args.max_memory)
        if args.offload_folder is None:
            offload_tmp = tempfile.TemporaryDirectory(prefix="eagle3_offload_")
        kwargs["offload_folder"] = args.offload_folder or offload_tmp.name  # type: ignore[union-attr]
    verifier = load_verifier(args.verifier, revision=args.revision, **kwargs)
    placement = Counter(str(d) for d in (getattr(verifier, "hf_device_map", None) or {}).values())
    if placement:
        print(f"[extract] verifier placed on {dict(placement)} (module groups per device)", file=sys.stderr)
    if not args.device_map:
        device = args.device or (f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
        verifier.to(device)  # type: ignore[arg-type]  # functools.wraps on PreTrainedModel.to hides self from mypy
    fingerprint = tokenizer_fingerprint(load_tokenizer(args.verifier, revision=args.revision))
    summary = extract_features(verifier, fingerprint, args.data, args.output, aux_indices=aux, dtype=args.dtype,
                               samples_per_shard=args.samples_per_shard, max_shard_bytes=args.max_shard_mb << 20,
                               verifier_name=args.verifier, verifier_revision=args.revision,
                               progress=not args.no_progress)
    if offload_tmp is not None:
        offload_tmp.cleanup()
    print(json.dumps(summary))
    return 0


def parse_device_map(value: str) -> str | dict:
    """`auto`-style strategies pass through; otherwise a JSON object (inline or a file) of module -> device."""
    if value in ("auto", "balanced", "balanced_low_0", "sequential"):
        return value
    text = Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError:
        raise SystemExit(f"--device-map {value!r}: not auto/balanced/balanced_low_0/sequential, a JSON file or "
                         f"JSON text") from None
    if not isinstance(mapping, dict):
        raise SystemExit(f"--device-map {value!r}: expected a JSON object of module name -> device")
    return mapping


def parse_max_memory(value: str) -> dict:
    """`0=70GiB,1=70GiB,cpu=200GiB` -> {0: "70GiB", 1: "70GiB", "cpu": "200GiB"} (plain numbers are bytes)."""
    budget: dict = {}
    for item in value.split(","):
        device, sep, size = item.partition("=")
        device, size = device.strip(), size.strip()
        if not sep or not device or not size:
            raise SystemExit(f"--max-memory {value!r}: expected DEVICE=SIZE[,DEVICE=SIZE...], e.g. 0=70GiB,cpu=200GiB")
        budget[int(device) if device.isdigit() else device] = int(size) if size.isdigit() else size
    return budget
