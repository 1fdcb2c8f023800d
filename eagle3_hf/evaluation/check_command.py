"""`eagle3-hf check`: the serving lint (publish/check.py) and, with `--endpoint`, the live check: a running vLLM or
SGLang server that serves the drafter is sent a few prompts and its per-position acceptance is compared with what
training recorded on the validation split (evaluation/live_check.py measures, publish/served_acceptance.py compares).

Exit status: 0 when nothing is wrong, 1 on any error (a lint error, or served acceptance below the margin), and
NO_VERDICT (3) when the lint found no error but too few verify steps reached some draft position for the live check
to judge it (served_acceptance.py's evidence rule): the last line is then "not enough evidence: ask more prompts".

The live half lives here, below the lint, because it reads prompt sets and talks to servers like `evaluate` does.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import UsageError
from ..publish.check import add_arguments as add_lint_arguments
from ..publish.check import findings_of, report
from ..publish.report import LEVELS, Finding
from ..publish.served_acceptance import MIN_VERIFY_STEPS, TOLERANCE, AcceptanceComparison

NO_VERDICT = 3  # exit status: the live check had too few verify steps to judge (not an error, not a pass)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_lint_arguments(parser)
    live = parser.add_argument_group("live check: a running server that serves the drafter (live_check.py)")
    live.add_argument("--endpoint", default=None, metavar="URL",
                      help="a vLLM or SGLang server serving this drafter (e.g. http://127.0.0.1:8000): send it "
                           "prompts and compare its per-position acceptance with the validation accuracies training "
                           "recorded; a gap beyond the margin is an error. --engine names its engine (all: detect)")
    live.add_argument("--prompts", default="dev", help="--endpoint: mt-bench, dev or a JSONL file, as evaluate "
                      "takes them (default: %(default)s)")
    live.add_argument("--num-prompts", type=int, default=8, help="--endpoint: prompts sent (default: %(default)s)")
    live.add_argument("--max-new-tokens", type=int, default=64, help="--endpoint: tokens per answer (default: "
                      "%(default)s)")
    live.add_argument("--tolerance", type=float, default=TOLERANCE,
                      help="--endpoint: how far below the recorded conditional accuracy a served position may be, "
                           "beyond chance, for train/serve prompt differences (default: %(default)s)")
    live.add_argument("--min-verify-steps", type=int, default=MIN_VERIFY_STEPS, metavar="N",
                      help="--endpoint: verify steps that must reach a draft position before it is judged (more "
                           "where a served rate of 0 could not yet fail); fewer: no verdict, exit status "
                           f"{NO_VERDICT}, 'not enough evidence: ask more prompts' (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    findings, versions = findings_of(args)
    if not args.endpoint:
        return report(findings, args, versions)
    live, comparison = live_finding(args)
    findings = sorted(findings + [live], key=lambda f: LEVELS.index(f.level))
    undecided = comparison.verdict == "undecided"
    line = f"not enough evidence: ask more prompts ({comparison.shortfall()})" if undecided else None
    code = report(findings, args, versions, instead_of_ok=line)
    return NO_VERDICT if code == 0 and undecided else code


def live_finding(args: argparse.Namespace) -> tuple[Finding, AcceptanceComparison]:
    """`--endpoint`: the served acceptance against the recorded one, as a finding (an error beyond the margin, a
    warning without enough evidence), and the comparison."""
    from ..features.api_key import api_key
    from ..publish.served_acceptance import compare, recorded_accuracies
    from .evaluate import load_prompts, prompt_turns
    from .live_check import measure, recorded_chat_template_kwargs, resolve_drafter

    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.min_verify_steps < 1:
        raise UsageError("--num-prompts, --max-new-tokens and --min-verify-steps must be >= 1")
    drafter_dir = resolve_drafter(args.drafter, args.revision)
    recorded = recorded_accuracies(drafter_dir, args.drafter)
    mode = recorded_chat_template_kwargs(drafter_dir)  # rendered in the thinking mode the drafter was trained in
    rows, _name = load_prompts(args.prompts, args.num_prompts)
    prompts = [(prompt_turns(row) or [""])[0] for row in rows]
    rendered = f", chat_template_kwargs {json.dumps(mode)}" if mode else ""
    print(f"sending {len(prompts)} prompts ({args.max_new_tokens} tokens each, greedy{rendered}) to {args.endpoint} "
          "...", file=sys.stderr)
    served = measure(args.endpoint, prompts, args.max_new_tokens, engine=args.engine, key=api_key(),
                     chat_template_kwargs=mode)
    comparison = compare(served, recorded, tolerance=args.tolerance, min_steps=args.min_verify_steps)
    level = {"pass": "info", "fail": "error", "undecided": "warning"}[comparison.verdict]
    return Finding(level, "served-acceptance", comparison.line(served.engine)), comparison
