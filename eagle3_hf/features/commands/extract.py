"""`eagle3-hf extract`: run the verifier over a prepared dataset and write its features to shards.

The pipeline's offline mode (docs/contracts.md). `--engine` (and `--endpoint`) pick a row of the table
(features/table.py), whose route adds its own flags here and reads them into its options record; the route's
features are written by `write.write_features`. Under `torchrun` / `accelerate launch` each rank takes samples i
with i % world_size == rank, writes its own shards and journal, and rank 0 merges all journals into manifest.json
once every sample is accounted for (over several nodes `--output` must be shared, or `--per-node-output` has each
node merge its own part: write.py; `check_output_shared`, the launch policy of those two flags, says which at
launch, as train/nodes.py does for training's directories). Killed at any point, the same command resumes
(write.py, store.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ... import nodes
from ...data.prepared_samples import PreparedDataset
from ...errors import UsageError
from ..table import (
    SourceRequest,
    add_route_arguments,
    endpoint_engines,
    engine_help,
    engine_kind,
    engines,
    extract_kinds,
    open_source,
    options_from_args,
)
from ..write import StoreOptions, write_features


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
    parser.add_argument("--device", default=None, help="device for the verifier, or the part of it that runs here "
                                                       "(default cuda:LOCAL_RANK or cpu)")
    parser.add_argument("--torch-dtype", default="auto", help="verifier compute dtype (auto = checkpoint's)")
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--max-shard-mb", type=int, default=1024, help="a shard is closed at this size too")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--engine", choices=engines(), default="transformers", help=engine_help())
    parser.add_argument("--endpoint", default=None, metavar="URL",
                        help=f"with --engine {' or '.join(endpoint_engines())}: the running server that computes "
                             "the states (its engine's group below says how it must be started)")
    add_route_arguments(parser, extract_kinds())


def check_output_shared(out_dir: str | Path, per_node: bool) -> None:
    """At launch, before any verifier is loaded: over several nodes, rank 0's merge reads every node's journals,
    so `out_dir` must be one directory for all of them. Not shared: refused in one line, or with `per_node`
    (each node's own local directory) each node's first process merges its own node's ranks
    (`write_features`). Shared, `per_node` changes nothing: rank 0 merges everything."""
    if not nodes.multi_node():
        return
    with nodes.ProcessGroup():
        layout = nodes.gather_layout()
        views = nodes.check_shared(out_dir, layout)
    seen = views[layout.rank]
    if min(views) == layout.nodes:
        return
    if not per_node:
        raise UsageError(nodes.not_shared(
            "extract --output", out_dir, layout, seen, "use a shared filesystem, or --per-node-output to have "
            "each node merge its own ranks' shards into a node part (`train --per-node-features` reads the parts)"))
    if max(views) > 1:  # some nodes share it, others do not: their node parts would overwrite one another
        raise UsageError(nodes.not_shared(
            "extract --output", out_dir, layout, seen, "--per-node-output needs a directory local to each node "
            "or one shared by all; some nodes share this one"))
    nodes.remember_node_local(out_dir, layout)


def open_data(args: argparse.Namespace) -> PreparedDataset:
    """--data, opened once for --verifier's tokenizer: samples another tokenizer prepared, or one of another class
    (the same --trust-remote-code at every stage), refused here, before the verifier loads, where a refusal costs
    nothing."""
    from ...verifier.loading import load_tokenizer

    return PreparedDataset(args.data, "all", tokenizer=load_tokenizer(args.verifier, revision=args.revision))


def run(args: argparse.Namespace) -> int:
    """`extract`: the route of --engine (and --endpoint) opened from the table, written by write_features."""
    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
    check_output_shared(args.output, args.per_node_output)  # before a verifier is loaded
    kind = engine_kind(args.engine, bool(args.endpoint))
    options = options_from_args(kind, args)  # read and checked once, before anything loads
    try:
        prepared = open_data(args)
        source = open_source(SourceRequest(kind, args.verifier, args.verifier, args.revision,
                                           None if aux is None else tuple(aux), args.features_dtype,
                                           tokenizer_fingerprint=prepared.tokenizer_fingerprint or "",
                                           options=options))
        # as many shards written at once as a route reads samples at once (vLLM's readers)
        store = StoreOptions(args.samples_per_shard, args.max_shard_mb << 20, writers=getattr(source, "readers", 1))
        summary = write_features(source, prepared, args.output, store=store, progress=not args.no_progress,
                                 desc="extract" if args.engine == engines()[0] else f"extract {args.engine}")
    finally:
        if options is not None:
            options.close()
    print(json.dumps(summary.as_dict()))
    return 0
