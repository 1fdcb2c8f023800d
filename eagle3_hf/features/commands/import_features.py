"""`eagle3-hf import-features`: bring hidden states captured by a serving engine's tools into our shards.

The format picks a row of the table (features/table.py; routes/engine_files.py reads the files and adds the
format's own flags), and `write.import_features` writes them in the capture's order. Neither format records its
layer ids: pass them (`--aux-layers` in our indices, or `--engine-layer-ids` as the engine was given them).
"""

from __future__ import annotations

import argparse
import json
from typing import cast

from ..interface import CapturedSource
from ..table import FeatureKind, SourceRequest, add_route_arguments, imported_formats, open_source, options_from_args
from ..write import StoreOptions, import_features


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("format", choices=imported_formats(), help="which tool wrote the files")
    parser.add_argument("source", help="speculators: its prepared dataset dir; specforge: its output dir")
    parser.add_argument("--verifier", required=True, help="the verifier the features came from (final norm, lm_head)")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--output", required=True, help="feature directory to write")
    parser.add_argument("--data", default=None, help="our prepared dataset: give imported samples its ids (by tokens)")
    parser.add_argument("--aux-layers", default=None, help="captured layers as our output_hidden_states indices a,b,c")
    parser.add_argument("--features-dtype", default="bf16", help="stored features: bf16 (default), fp8 or fp32")
    parser.add_argument("--samples-per-shard", type=int, default=64)
    parser.add_argument("--no-progress", action="store_true")
    add_route_arguments(parser, imported_formats())


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args.format, args)  # read and checked first
    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
    source = open_source(SourceRequest(cast(FeatureKind, args.format), args.source, args.verifier, args.revision,
                                       None if aux is None else tuple(aux), args.features_dtype,
                                       options=options))
    summary = import_features(cast(CapturedSource, source), args.output, prepared=args.data,
                              store=StoreOptions(args.samples_per_shard), progress=not args.no_progress)
    print(json.dumps(summary.as_dict()))
    return 0
