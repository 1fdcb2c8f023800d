"""`eagle3-hf evaluate`: our own decoder (eagle3_hf/evaluate.py), or with `--engine vllm` the drafter served by
vLLM beside it (vllm_eval.py). Kept apart from evaluate.py so that the engines depend on it, never it on them."""

from __future__ import annotations

import argparse

from .. import evaluate
from .vllm_eval import add_engine_arguments, run_engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    evaluate.add_arguments(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return run_engine(args) if args.engine == "vllm" else evaluate.run(args)
