"""`eagle3-hf <command>`: one entry point, one module per pipeline stage.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only
when its command runs, so `eagle3-hf --help` stays fast and a stage's heavy imports stay local.

User errors (eagle3_hf/errors.py) end as one line `error: ...` on stderr and exit status 1; `--debug` (before
the command, or anywhere but in `train`'s arguments, where TrainingArguments owns it) or EAGLE3_HF_DEBUG=1
shows their traceback. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from .engines.forked import run_entry_in_warm
from .errors import DEBUG_ENV, run_reporting_user_errors

COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("eagle3_hf.data.prepare", "render conversations with the verifier's chat template + loss masks"),
    "regenerate": ("eagle3_hf.features.commands.regenerate",
                   "rewrite assistant turns with the verifier (in-process or endpoint); --features-out: + features"),
    "extract": ("eagle3_hf.features.commands.extract",
                "run the verifier and write hidden states to sharded safetensors"),
    "serve-features": ("eagle3_hf.features.commands.serve_features",
                       "keep vLLM loaded and serve hidden states over HTTP to `train --features URL`"),
    "serve-vllm": ("eagle3_hf.features.commands.serve_vllm",
                   "start vLLM's OpenAI server with the extraction config, for `extract --engine vllm --endpoint`"),
    "import-features": ("eagle3_hf.features.commands.import_features",
                        "import hidden states written by speculators or SpecForge"),
    "diff-features": ("eagle3_hf.evaluation.feature_diff", "compare two extractions of the same samples"),
    "vocab": ("eagle3_hf.data.vocab", "build the draft vocabulary (d2t / t2d) from assistant tokens"),
    "plan": ("eagle3_hf.train.plan", "GPU memory, feature disk, FLOPs and time of a training run, before it runs"),
    "train": ("eagle3_hf.scripts.train", "train a drafter: runs the training script (eagle3_hf/scripts/train.py)"),
    "evaluate": ("eagle3_hf.evaluation.command",  # eagle3_hf.evaluation.evaluate, or --engine vllm beside it
                 "speculative decoding with the verifier: acceptance length, lossless check"),
    "check": ("eagle3_hf.evaluation.check_command",  # the lint of publish/check.py, + --endpoint
              "lint a drafter checkpoint for silent serving failures"),
    "export": ("eagle3_hf.publish.export", "export a drafter to the standard or speculators layout"),
    "push": ("eagle3_hf.publish.hub", "check a drafter and push it to the Hub with a model card"),
}


# commands that open a verifier, its config or its tokenizer: they take --trust-remote-code (verifier/remote_code.py;
# `train` has it among its ModelArguments)
OPENS_VERIFIER = ("prepare", "regenerate", "extract", "serve-features", "serve-vllm", "import-features",
                  "diff-features", "plan", "evaluate", "check", "export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3-hf", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show the traceback of a user error "
                        "(also EAGLE3_HF_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a user error becomes `error: <message>` on stderr and exit status 1."""
    if argv is None:  # this process's own command: a fork of the test suite's warm process may run it
        run_entry_in_warm()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = False
    while argv[:1] == ["--debug"]:
        debug, argv = True, argv[1:]
    if argv[:1] != ["train"] and "--debug" in argv:  # train keeps TrainingArguments' own --debug
        debug, argv = True, [a for a in argv if a != "--debug"]
    if debug:  # child processes (the vLLM runner) show their logs and tracebacks too
        os.environ[DEBUG_ENV] = "1"
    return run_reporting_user_errors(_dispatch, argv, debug)


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv)  # prints usage / error and exits
        return 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    if hasattr(module, "main_argv"):  # commands that parse their own arguments (HfArgumentParser)
        return int(module.main_argv(rest) or 0)
    args = command_parser(name).parse_args(rest)
    if name in OPENS_VERIFIER:
        from .verifier.remote_code import set_trusted

        set_trusted(args.trust_remote_code)
    return int(module.run(args) or 0)


def command_parser(name: str) -> argparse.ArgumentParser:
    """The argparse parser of an argparse command (not `train`, whose parser is HfArgumentParser's)."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"eagle3-hf {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    if name in OPENS_VERIFIER:
        from .verifier.remote_code import add_trust_argument

        add_trust_argument(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main())
