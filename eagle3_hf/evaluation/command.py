"""`eagle3-hf evaluate`: our own decoder (eagle3_hf/evaluation/evaluate.py), `--sweep` over SGLang configurations
(eagle3_hf/evaluation/sweep.py), or with `--engine vllm` the drafter served by vLLM beside it
(eagle3_hf/evaluation/vllm_engine.py), with `--engine llamacpp` by llama.cpp
(eagle3_hf/evaluation/llamacpp_engine.py). Kept apart from evaluate.py so that the sweep and the engines depend on it,
never it on them."""

from __future__ import annotations

import argparse

from . import evaluate, sweep
from .llamacpp_engine import add_llamacpp_arguments, run_llamacpp
from .vllm_engine import add_engine_arguments, run_engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    evaluate.add_arguments(parser)
    add_engine_arguments(parser)
    add_llamacpp_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        return run_engine(args)
    if args.engine == "llamacpp":
        return run_llamacpp(args)
    return sweep.run_cli(args) if args.sweep else evaluate.run(args)
