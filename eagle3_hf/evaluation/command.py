"""`eagle3-hf evaluate`: our own decoder (eagle3_hf/evaluation/evaluate.py), `--sweep` over SGLang configurations
(eagle3_hf/evaluation/sweep.py), or with `--engine NAME` the drafter served by that engine beside it, for each
engine the table (eagle3_hf/engines/table.py) says `evaluate` serves in: vLLM (eagle3_hf/evaluation/vllm_engine.py)
and llama.cpp (eagle3_hf/evaluation/llamacpp_engine.py). Kept apart from evaluate.py so that the sweep and the engines
depend on it, never it on them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ..engines.table import evaluated_engines
from . import evaluate, sweep
from .llamacpp_engine import add_llamacpp_arguments, run_llamacpp
from .vllm_engine import add_engine_arguments, run_engine

# the table's engines that `evaluate --engine` serves in, each with its run (tests/engines/test_table.py
# keeps the two in step)
RUNNERS: dict[str, Callable[[argparse.Namespace], int]] = {"vllm": run_engine, "llamacpp": run_llamacpp}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    evaluate.add_arguments(parser)
    add_engine_arguments(parser)
    add_llamacpp_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.engine in evaluated_engines():
        return RUNNERS[args.engine](args)
    return sweep.run_cli(args) if args.sweep else evaluate.run(args)
