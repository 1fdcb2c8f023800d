"""`eagle3-hf regenerate`: the verifier (or a server) answers the conversations again; with --features-out its
features of prompt + answer are written in the same pass.

`--engine` (and `--endpoint`) pick a row of the answering table (features/generators.py), whose route adds its own
flags here and reads them into its options record; the flags every route reads are read once into the job
(`data.regenerate.RegenerateJob`) and the route's runner does the rest: the in-process verifier
(transformers_generation.py), vLLM (vllm_generation.py) or any OpenAI-compatible server (data/regenerate.py).
Whether --features-out is taken is the row's capability, checked here before anything loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ...data.regenerate import GenerationOptions, RegenerateJob, add_common_arguments
from ..generators import (
    add_generator_arguments,
    check_features,
    engine_help,
    engines,
    generator,
    options_class,
    run_generator,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--engine", choices=engines(), default=None, help=engine_help())
    feats = parser.add_argument_group("features in the same pass (--verifier only; replaces prepare + extract)")
    feats.add_argument("--features-out", default=None,
                       help="also write the verifier's features of prompt + answer here, as `extract` writes them")
    feats.add_argument("--prepared-out", default=None, help="and the prepared dataset (`prepare`'s output) here")
    feats.add_argument("--features-dtype", default="bf16", help="bf16 (default), fp8 (e4m3 + per-row scale) or fp32")
    feats.add_argument("--aux-layers", default=None, help="three output_hidden_states indices (default 2,N//2,N-3)")
    feats.add_argument("--max-seq-len", type=int, default=None, help="truncate samples to this many tokens")
    feats.add_argument("--samples-per-shard", type=int, default=64)
    add_generator_arguments(parser)


def job_from_args(args: argparse.Namespace) -> RegenerateJob:
    """The flags every route reads, once."""
    generation = GenerationOptions(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.max_turns,
                                   args.max_seq_len)
    return RegenerateJob(args.input, Path(args.output), generation, split=args.split, limit=args.limit,
                         features=Path(args.features_out) if args.features_out else None,
                         prepared=Path(args.prepared_out) if args.prepared_out else None,
                         verifier=args.verifier, endpoint=args.endpoint, revision=args.revision,
                         chat_template_kwargs=args.chat_template_kwargs, retry_skipped=args.retry_skipped,
                         aux_indices=tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None,
                         features_dtype=args.features_dtype, samples_per_shard=args.samples_per_shard)


def run(args: argparse.Namespace) -> int:
    """`regenerate`: the route of --engine (and --endpoint) from the table, its capability checked, its options
    read once, then its runner."""
    row = generator(args.engine, bool(args.endpoint))
    check_features(row, bool(args.features_out))
    options = options_class(row).from_args(args)  # read and checked once, before anything loads
    try:
        return run_generator(row, job_from_args(args), options)
    finally:
        options.close()
