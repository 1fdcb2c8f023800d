"""`eagle3-hf extract`: run the verifier over a prepared dataset and write its features to shards.

The pipeline's offline mode (docs/contracts.md). One verifier forward per sample (no padding, so a sample's features
do not depend on its neighbours and a resumed run is bit-identical to an uninterrupted one). Under
`torchrun` / `accelerate launch` each rank takes samples i with i % world_size == rank, writes its own
shards and journal, and rank 0 merges all journals into manifest.json once every sample is accounted for (over
several nodes `--output` must be shared, or `--per-node-output` has each node merge its own part: write.py).
Killed at any point, the same command resumes (write.py, store.py). The route itself is `TransformersFeatures`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...data.prepared_samples import PreparedDataset
from ...engines.vllm_args import (
    add_engine_arguments,
    add_run_arguments,
    check_batched_tokens,
    check_offline,
    check_run_arguments,
    engine_from_args,
)
from ...errors import UsageError
from ...verifier.capture import capture_features
from ...verifier.family import check_aux_indices, default_aux_indices
from ...verifier.placement import add_placement_arguments, placement_kwargs
from ..interface import PreparedSample, SampleFeatures, SourceIdentity, VerifierIdentity
from ..records import canonical_dtype
from ..table import SourceRequest, engine_kind, engines, options_from_args
from ..table import open_source as open_source_of
from ..write import (
    MERGE_TIMEOUT_S,
    ExtractionSummary,
    StoreOptions,
    check_output_shared,
    sample_token_limit,
    write_features,
)

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedModel


def verifier_info(verifier: PreTrainedModel, name: str | None = None, revision: str | None = None) -> dict[str, Any]:
    """The manifest's `verifier` record of a loaded verifier."""
    return VerifierIdentity.of_model(verifier, name, revision).as_dict()


class TransformersFeatures:
    """The verifier in this process, through forward hooks: one forward per sample, no padding, so a sample's
    features do not depend on its neighbours and a resumed run is bit-identical to an uninterrupted one."""

    def __init__(self, verifier: PreTrainedModel, tokenizer_fingerprint: str, aux_indices: Sequence[int] | None = None,
                 dtype: str = "bfloat16", verifier_name: str | None = None, verifier_revision: str | None = None,
                 max_model_len: int | None = None):
        self.verifier = verifier
        self.max_sample_tokens = sample_token_limit(max_model_len)
        who = VerifierIdentity.of_model(verifier, verifier_name, verifier_revision)
        indices = check_aux_indices(aux_indices or default_aux_indices(who.num_hidden_layers), who.num_hidden_layers)
        self.identity = SourceIdentity(who, tokenizer_fingerprint, tuple(indices), canonical_dtype(dtype))

    def check(self, lengths: Sequence[int]) -> int | None:
        return self.max_sample_tokens  # --max-model-len, as vLLM counts it (write.sample_token_limit); else any

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        for sample in samples:
            feats = capture_features(self.verifier, sample.input_ids, self.identity.aux_layer_indices)
            yield SampleFeatures(sample, feats["aux_hidden_states"], feats["last_hidden_state"],
                                 feats["verifier_greedy"])

    def report(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class TransformersOptions:
    """The transformers route's own options: a verifier already loaded (else it is loaded from the request's
    verifier with `load_kwargs`, from_pretrained's keywords: placement, dtype), the device to move it to (unless
    a device map placed it) and --max-model-len."""

    model: PreTrainedModel | None = None
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    max_model_len: int | None = None


def open_source(request: SourceRequest) -> TransformersFeatures:
    """The table's opener (table.py): the verifier in this process."""
    from ...verifier.loading import load_verifier

    options = request.options if isinstance(request.options, TransformersOptions) else TransformersOptions()
    if request.target and request.target != request.verifier:  # train --features hf:VERIFIER
        raise UsageError(f"--features hf:{request.target} names another verifier than --verifier "
                         f"{request.verifier}: the teacher and the features must come from one verifier")
    verifier = options.model
    if verifier is None:
        verifier = load_verifier(request.verifier, revision=request.revision, **options.load_kwargs)
        placement = Counter(str(d) for d in (getattr(verifier, "hf_device_map", None) or {}).values())
        if placement:
            print(f"[extract] verifier placed on {dict(placement)} (module groups per device)", file=sys.stderr)
    if options.device is not None and not getattr(verifier, "hf_device_map", None):
        verifier.to(options.device)  # type: ignore[arg-type]  # functools.wraps on PreTrainedModel.to hides self
    return TransformersFeatures(verifier, request.tokenizer_fingerprint, request.aux_indices, request.dtype,
                                request.verifier or None, request.revision, options.max_model_len)


def named_verifier(target: str) -> tuple[str | None, str | None]:
    """`--features hf:NAME` names NAME (no revision); `hf` names none."""
    return (target or None), None


def extract_features(verifier: PreTrainedModel, tokenizer_fingerprint: str,
                     prepared_dataset: datasets.Dataset | str | Path, out_dir: str | Path,
                     aux_indices: Sequence[int] | None = None, dtype: str = "bfloat16",
                     store: StoreOptions | None = None, verifier_name: str | None = None,
                     verifier_revision: str | None = None, rank: int | None = None, world_size: int | None = None,
                     progress: bool = True, merge_timeout_s: float | None = MERGE_TIMEOUT_S,
                     max_model_len: int | None = None) -> ExtractionSummary:
    """Write features for this rank's slice of `prepared_dataset` to `out_dir`; returns its summary. With
    `max_model_len`, samples of max_model_len tokens or more are skipped and counted (write.py)."""
    source = TransformersFeatures(verifier, tokenizer_fingerprint, aux_indices, dtype, verifier_name,
                                  verifier_revision, max_model_len)
    prepared = PreparedDataset(prepared_dataset, "all", tokenizer_fingerprint=tokenizer_fingerprint)
    return write_features(source, prepared, out_dir, store=store, rank=rank, world_size=world_size,
                          progress=progress, merge_timeout_s=merge_timeout_s)


# ---------------------------------------------------------------- CLI

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", default="smollm2-135m-instruct", help="verifier name, Hub id or local path")
    parser.add_argument("--revision", default=None, help="verifier revision (Hub)")
    parser.add_argument("--data", required=True, help="prepared dataset directory (from `eagle3-hf prepare`)")
    parser.add_argument("--output", required=True, help="feature directory (created, or resumed/appended)")
    parser.add_argument("--per-node-output", action="store_true",
                        help="over several nodes, where --output is a directory local to each node: each node "
                             "merges its own ranks' shards into a node part, which `train --per-node-features` "
                             "reads (default: --output must be shared by every node; checked at launch)")
    parser.add_argument("--aux-layers", default=None,
                        help="three output_hidden_states indices a,b,c in 1..N-1 (default 2,N//2,N-3)")
    parser.add_argument("--features-dtype", default="bf16",
                        help="stored features: bf16 (default), fp8 (e4m3 + per-row scale) or fp32")
    add_placement_arguments(parser, "0=70GiB,1=70GiB,cpu=200GiB")
    parser.add_argument("--device", default=None, help="device for the verifier (default cuda:LOCAL_RANK or cpu)")
    parser.add_argument("--torch-dtype", default="auto", help="verifier compute dtype (auto = checkpoint's)")
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--max-shard-mb", type=int, default=1024, help="a shard is closed at this size too")
    parser.add_argument("--no-progress", action="store_true")
    engine = parser.add_argument_group("--engine vllm (the serving engine computes the states; `make vllm`)")
    engine.add_argument("--engine", choices=engines(), default="transformers",
                        help="transformers: forward hooks in this process; vllm: vLLM's extract_hidden_states in "
                             "its own venv, then the verifier's final norm and lm_head here; sglang: a running "
                             "SGLang server's aux hidden states (--endpoint), then the verifier's last layer, "
                             "final norm and lm_head here (default: %(default)s)")
    add_run_arguments(engine, "prompts", "; with --endpoint, seconds per request and its file (default 600)")
    engine.add_argument("--endpoint", default=None, metavar="URL",
                        help="with --engine vllm: a running vLLM OpenAI server started with the extraction config "
                             "(`eagle3-hf serve-vllm`) computes the states, --vllm-batch-size requests at a time; "
                             "this machine must see its storage directory. With --engine sglang (required): a "
                             "running SGLang server started with aux capture (docs/guide.md)")
    engine.add_argument("--vllm-storage", default=None, metavar="DIR",
                        help="with --endpoint: the server's storage directory, the only place whose files are read "
                             "and deleted (default: the one `eagle3-hf serve-vllm` names)")
    add_engine_arguments(parser)
    sglang = parser.add_argument_group("--engine sglang (a running SGLang server computes the states; --endpoint)")
    sglang.add_argument("--sglang-requests", type=int, default=4, metavar="N",
                        help="requests in flight, one sample each (default %(default)s)")
    sglang.add_argument("--sglang-timeout", type=float, default=600.0, metavar="S",
                        help="seconds per request, its answer included (default %(default)s)")


def data_fingerprint(args: argparse.Namespace) -> str:
    """The fingerprint of --verifier's tokenizer, refused first when its class is not the one that prepared --data
    (the same --trust-remote-code at every stage)."""
    from ...data.fingerprint import tokenizer_fingerprint
    from ...data.prepared_format import check_prepared_tokenizer
    from ...verifier.loading import load_tokenizer

    tokenizer = load_tokenizer(args.verifier, revision=args.revision)
    check_prepared_tokenizer(args.data, tokenizer)
    return tokenizer_fingerprint(tokenizer)


MEMORY_HINT = ("extract it with --engine vllm over the GPUs that hold it (--tensor-parallel-size; `eagle3-hf plan` "
               "sizes the engine), give it more memory (--device-map auto, --max-memory), or pass --offload-folder "
               "DIR to spill the rest to disk, read back at every forward")


def transformers_options(args: argparse.Namespace) -> tuple[TransformersOptions, Any]:
    """`extract`'s transformers options, and the temporary offload folder to remove once written (or None)."""
    from ...verifier.memory import require_memory

    placed, offload_tmp = placement_kwargs(args)
    device = None
    if not args.device_map:
        device = args.device or (f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu")
    try:  # before a weight is read: a verifier its memory cannot hold is refused (verifier/memory.py)
        require_memory(args.verifier, args.revision, args.torch_dtype, placed.get("device_map"),
                       placed.get("max_memory"), device, args.offload_folder, MEMORY_HINT)
    except UsageError:
        if offload_tmp is not None:
            offload_tmp.cleanup()
        raise
    return TransformersOptions(load_kwargs={"dtype": args.torch_dtype, **placed}, device=device,
                               max_model_len=args.max_model_len), offload_tmp


def vllm_options(args: argparse.Namespace) -> tuple[Any, None]:
    """`extract --engine vllm`'s options for the vLLM routes (their typed record, read from the arguments through
    the table: vllm_spec.VllmOptions), checked first."""
    if args.device_map or args.max_memory or args.offload_folder or args.device:
        raise UsageError("--engine vllm places the verifier itself: drop --device-map/--max-memory/--offload-folder/"
                         "--device (use --tensor-parallel-size)")
    check_offline(engine_from_args(args))
    check_run_arguments(args)
    if args.max_model_len and not args.endpoint:  # else checked once the longest sample is known (vllm_spec.py)
        check_batched_tokens(engine_from_args(args), args.max_model_len)
    return options_from_args(engine_kind("vllm", bool(args.endpoint)), args), None


def sglang_options(args: argparse.Namespace) -> tuple[Any, None]:
    """`extract --engine sglang`'s options (sglang_server.SglangOptions, read through the table)."""
    if args.device_map or args.max_memory or args.offload_folder:
        raise UsageError("--engine sglang runs the verifier in its server: drop --device-map/--max-memory/"
                         "--offload-folder (--device places the last layer, norm and head run here)")
    return options_from_args("sglang-server", args), None


OPTIONS = {"transformers": transformers_options, "vllm": vllm_options, "vllm-server": vllm_options,
           "sglang-server": sglang_options}


def run(args: argparse.Namespace) -> int:
    """`extract`: the route of --engine (and --endpoint) opened from the table (table.py), written by
    write_features."""
    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
    check_output_shared(args.output, args.per_node_output)  # before a verifier is loaded
    if args.endpoint and args.engine == "transformers":
        raise UsageError("--endpoint URL needs --engine vllm (a vLLM OpenAI server started by `eagle3-hf serve-vllm`) "
                         "or --engine sglang (a SGLang server)")
    kind = engine_kind(args.engine, bool(args.endpoint))
    options, offload_tmp = OPTIONS[kind](args)
    fingerprint = data_fingerprint(args)  # before the verifier loads: a refusal costs nothing
    source = open_source_of(SourceRequest(kind, args.verifier, args.verifier, args.revision,
                                          None if aux is None else tuple(aux), args.features_dtype,
                                          tokenizer_fingerprint=fingerprint, options=options))
    # as many shards written at once as a route reads samples at once (vLLM's readers)
    store = StoreOptions(args.samples_per_shard, args.max_shard_mb << 20, writers=getattr(source, "readers", 1))
    prepared = PreparedDataset(args.data, "all", tokenizer_fingerprint=fingerprint)
    summary = write_features(source, prepared, args.output, store=store, progress=not args.no_progress,
                             desc="extract" if kind == "transformers" else f"extract {args.engine}")
    if offload_tmp is not None:
        offload_tmp.cleanup()
    print(json.dumps(summary.as_dict()))
    return 0
