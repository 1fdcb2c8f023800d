"""`eagle3-hf evaluate --engine vllm`: the drafter served by vLLM, beside our own decoder on the same prompts.

The prompts are rendered with the verifier's chat template here, exactly as `evaluate` renders them, and
passed to vLLM as token ids, so both engines read identical inputs. vLLM runs in its own venv (vllm_env.py):
plain, then with the drafter (`speculative_config` with the method of the drafter's kind, engines/table.py: eagle3 or
dflash), with the engine options every vLLM route takes
(engines/vllm/vllm_args.py: tensor and expert parallelism, memory). On a GPU the two engines run one after the other,
each in its own process, so the plain one has exited, its memory freed, before the speculative one loads: a
verifier that takes a node (Kimi-K2.5 over 8 GPUs) is evaluated on that node. On the CPU both share one process
and each prompt's two runs are timed back to back (`--vllm-engines` chooses). τ and per-position acceptance come
from vLLM's own counters (`vllm:spec_decode_*`), the speedup from its own timings, the lossless check compares token
ids with plain vLLM (top-2 logprob gaps tell numerical ties apart). Unless --skip-transformers, `evaluate_drafter`
runs the same prompts in-process and the train/serve gap is printed as one number: vLLM τ minus transformers τ.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..constants import VLLM_EVALUATION_FILE  # the model card reads it
from ..engines.table import checkpoint_kind, evaluated_engines
from ..engines.vllm import vllm_args
from ..engines.vllm.vllm_env import run_vllm
from ..engines.vllm.vllm_request import GenerationRequest
from ..errors import UsageError, debug_requested
from .train_serve_gap import compare_engines

VLLM_DEFAULT_MEMORY = 0.9  # vLLM's own default gpu_memory_utilization (vllm/engine/arg_utils.py)
ENGINE_LAYOUTS = ("auto", "sequential", "together")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `evaluate` takes for engines other than its own decoder: vLLM's shared engine group and how its
    plain and speculative engines share the machine."""
    parser.add_argument("--engine", choices=["transformers", *evaluated_engines()], default="transformers",
                        help="transformers: our in-process decoder; vllm: serve the drafter in vLLM (`make vllm`), "
                             "llamacpp: in llama.cpp's llama-server (`make llamacpp`), and print our decoder's τ "
                             "beside it (default: %(default)s)")
    parser.add_argument("--skip-transformers", action="store_true",
                        help="--engine vllm/llamacpp: measure the engine only (no train/serve gap; a verifier that "
                             "only vLLM's tensor parallelism fits)")
    group = vllm_args.add_engine_arguments(parser, "--engine vllm: vLLM's engine (passed to vLLM as named; "
                                                   "vllm/engine/arg_utils.py)")
    group.add_argument("--vllm-engines", choices=ENGINE_LAYOUTS, default="auto",
                       help="sequential: the plain engine in its own process, which exits before the speculative one "
                            "loads, so each may take --gpu-memory-utilization of every GPU; together: both in one "
                            "process, each prompt's two runs timed back to back, each engine given half of "
                            "--gpu-memory-utilization; auto: sequential on a GPU, together on the CPU (its KV cache "
                            "is VLLM_CPU_KVCACHE_SPACE GiB per engine)")


def _margins(run: dict, i: int, n: int) -> list[float]:
    """Top-1 minus top-2 logprob per generated token of prompt i (a logit gap: log-softmax shifts both
    equally); infinite (never a tie) where vLLM returned none."""
    found = (run.get("margins") or [[]] * (i + 1))[i]
    return [float("inf") if m is None else m for m in found] + [float("inf")] * (n - len(found))


def cut_final_step(steps: list[int], output_len: int, max_new_tokens: int) -> list[int]:
    """vLLM's accepted drafts per verify step, counted as `evaluate` counts them.

    vLLM drafts k tokens at every step and counts the accepted ones even past max_tokens (or an eos), where
    they are cut from the output; evaluate drafts only what can be kept. So the final step keeps at most
    the drafts it emitted: all of them when it ended on an eos draft, else all but its bonus token.
    """
    if not steps:
        return []
    emitted = output_len - (1 + sum(a + 1 for a in steps[:-1]))  # the prefill emits the first token
    cap = emitted if output_len < max_new_tokens else emitted - 1
    return steps[:-1] + [max(0, min(steps[-1], cap))]


def summarize(plain: dict, spec: dict, k: int, temperature: float, max_new_tokens: int) -> dict[str, Any]:
    """vLLM's two runs -> τ, per-position acceptance, speedup, lossless (greedy), one row per prompt."""
    from ..decoding.stats import compare_to_greedy

    rows, statuses = [], []
    for i, (base, fast, counts) in enumerate(zip(plain["outputs"], spec["outputs"], spec["spec"])):
        status = where = None
        if temperature <= 0:
            status, where = compare_to_greedy(fast, _margins(spec, i, len(fast)), base, _margins(plain, i, len(base)))
            statuses.append(status)
        drafts = counts["drafts"]
        rows.append({"prompt": i, "new_tokens": len(fast), "drafts": drafts, "accepted": counts["accepted"],
                     "accepted_per_pos": counts["accepted_per_pos"], "tokens": fast,
                     "accepted_per_step": counts.get("per_step_accepted") or [],
                     "accepted_per_step_cut": cut_final_step(counts.get("per_step_accepted") or [], len(fast),
                                                             max_new_tokens),
                     "tau": 1 + counts["accepted"] / drafts if drafts else None, "lossless": status,
                     "first_divergence": where, "baseline_seconds": plain["seconds"][i],
                     "speculative_seconds": spec["seconds"][i]})
    drafts = sum(r["drafts"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    per_pos = [sum((r["accepted_per_pos"] + [0] * k)[j] for r in rows) for j in range(k)]
    cut = [a for r in rows for a in r["accepted_per_step_cut"]]
    base_tps = sum(len(o) for o in plain["outputs"]) / sum(plain["seconds"]) if sum(plain["seconds"]) else None
    spec_tps = sum(len(o) for o in spec["outputs"]) / sum(spec["seconds"]) if sum(spec["seconds"]) else None
    greedy = temperature <= 0
    return {
        "engine": "vllm", "vllm_version": spec.get("vllm_version"), "k": k, "temperature": temperature,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_length_as_evaluate_counts": 1 + sum(cut) / len(cut) if cut else None,
        "per_position_acceptance": [a / drafts if drafts else None for a in per_pos],
        "num_drafts": drafts, "num_accepted_tokens": accepted, "new_tokens": sum(len(o) for o in spec["outputs"]),
        "speedup": spec_tps / base_tps if base_tps and spec_tps else None,
        "tokens_per_second": {"baseline": base_tps, "speculative": spec_tps},
        "seconds": {"baseline": sum(plain["seconds"]), "speculative": sum(spec["seconds"]),
                    "load_baseline": plain.get("load_seconds"), "load_speculative": spec.get("load_seconds")},
        "lossless": (statuses.count("mismatch") == 0) if greedy else None,
        "numerical_ties": statuses.count("tie") if greedy else None,
        "mismatches": statuses.count("mismatch") if greedy else None,
        "per_prompt": rows,
    }


def format_vllm_summary(summary: dict[str, Any]) -> str:
    """Lines for the terminal: vLLM's numbers, then transformers' τ and the gap when measured."""
    from .evaluate import format_summary

    text = f"vLLM {summary.get('vllm_version')}: {format_summary(summary)}"
    if summary.get("gap") is not None:
        text += (f"\ntransformers (eagle3-hf evaluate): tau {summary['transformers_acceptance_length']:.3f}; vLLM "
                 f"counted the same way (final step cut at max tokens): "
                 f"{summary['acceptance_length_as_evaluate_counts']:.3f}; "
                 f"prompts with equal accepted drafts at every step "
                 f"{summary['prompts_equal']}/{summary['num_compared']} (outputs differ by engine numerics: "
                 f"{summary['prompts_numerics']}, acceptance differs: "
                 f"{summary['prompts_differ']})\ntrain/serve gap (vLLM tau - transformers tau): {summary['gap']:+.3f}")
    return text


def engine_layout(choice: str, cpu: bool) -> str:
    """--vllm-engines: "auto" is one engine at a time on a GPU (each takes what it needs of every GPU) and both in
    one process on the CPU (timed prompt by prompt under the same machine load)."""
    if choice not in ENGINE_LAYOUTS:
        raise UsageError(f"--vllm-engines {choice!r}: expected one of {', '.join(ENGINE_LAYOUTS)}")
    return ("together" if cpu else "sequential") if choice == "auto" else choice


def split_memory(engine: dict[str, Any], engines: int) -> dict[str, Any]:
    """The engine options for each of `engines` vLLM instances in one process: an equal share of
    --gpu-memory-utilization (vLLM's default 0.9 when unset), vLLM's per-instance fraction of every GPU."""
    share = float(engine.get("gpu_memory_utilization") or VLLM_DEFAULT_MEMORY) / engines
    return dict(engine, gpu_memory_utilization=round(share, 4))


def run_engines(request: GenerationRequest, drafter: str, revision: str | None, layout: str, cpu: bool,
                runner: Callable[..., dict] | None = None, **runner_kwargs: Any) -> dict[str, Any]:
    """vLLM's plain and speculative runs of `request`: {"vllm_version", "plain": RUN, "spec": RUN} (vllm_runner.py).

    "sequential": two runner processes, the plain engine's finished (its process gone, and every GPU byte it held
    with it) before the speculative engine's starts. "together": one process holding both engines, each given
    half of the memory (on a GPU; the CPU backend sizes its KV cache by VLLM_CPU_KVCACHE_SPACE). `runner`: one
    process's run (default vllm_env.run_vllm).
    """
    runner = runner or run_vllm
    spec_request = request.replace(drafter=drafter, drafter_revision=revision)
    if layout == "together":
        engine = dict(request.engine)
        return runner(spec_request.replace(engine=engine if cpu else split_memory(engine, 2)), **runner_kwargs)
    plain = runner(request.replace(drafter=None, drafter_revision=None), **runner_kwargs)
    spec = runner(spec_request.replace(plain=False), **runner_kwargs)
    return {"vllm_version": spec.get("vllm_version"), "plain": plain["plain"], "spec": spec["spec"]}


def layout_line(layout: str, engine: dict[str, Any], cpu: bool) -> str:
    """What the terminal is told about how the two engines share the machine."""
    if layout == "sequential":
        return "one engine at a time (the plain one exits before the speculative one loads)"
    if cpu:
        return "both engines in one process"
    return (f"both engines in one process, each given {split_memory(engine, 2)['gpu_memory_utilization']:g} of "
            f"every GPU's memory")


def served_against_training(summary: dict[str, Any], drafter: str, revision: str | None) -> str | None:
    """`--skip-transformers`: vLLM's per-position acceptance against the validation accuracies the drafter recorded
    at training (publish/served_acceptance.py), into the summary as "served_vs_training"; the line to print (a
    WARNING on a gap beyond the margin, a NOTE when nothing was recorded), None when nothing was drafted."""
    from ..publish.served_acceptance import ServedCounts, compare, recorded_accuracies
    from .live_check import resolve_drafter

    try:
        recorded = recorded_accuracies(resolve_drafter(drafter, revision), drafter)
    except (OSError, ValueError) as exc:
        return f"NOTE: the train/serve gap is not checked: {exc}"
    rows = summary["per_prompt"]
    per_pos = tuple(sum((r["accepted_per_pos"] + [0] * summary["k"])[j] for r in rows) for j in range(summary["k"]))
    served = ServedCounts(f"vLLM {summary.get('vllm_version')}", summary["num_drafts"], per_pos, len(rows))
    if not served.drafts:
        return None
    comparison = compare(served, recorded)
    summary["served_vs_training"] = {"ok": comparison.ok, "verdict": comparison.verdict,
                                     "recorded_conditional_accuracy": recorded,
                                     "served_conditional_acceptance": [p.served for p in comparison.positions],
                                     "tolerance": comparison.tolerance, "line": comparison.line(served.engine)}
    head = {"pass": "served as trained", "fail": "WARNING", "undecided": "NOTE"}[comparison.verdict]
    return f"{head}: {comparison.line(served.engine)}"


def run_engine(args: argparse.Namespace) -> int:
    """`eagle3-hf evaluate --engine vllm`."""
    import torch

    from ..data.prepare import use_chat_template
    from ..engines.vllm.vllm_env import vllm_python
    from ..verifier.loading import load_config, load_tokenizer, resolve_verifier
    from ..verifier.remote_code import trusted
    from .evaluate import (
        check_pair,
        copy_to_drafter,
        default_dtype,
        drafter_mode,
        load_prompts,
        prompt_turns,
        render_prompt,
        write_outputs,
    )
    from .live_check import resolve_drafter

    if args.k < 1 or args.max_new_tokens < 1:
        raise UsageError("--k and --max-new-tokens must be >= 1")
    if args.turns != 1:
        raise UsageError("--engine vllm evaluates single-turn prompts: use --turns 1")
    if getattr(args, "topk", 1) != 1 or getattr(args, "sweep", False):
        raise UsageError("--engine vllm measures chain drafting (vLLM's eagle3 and dflash methods): drop "
                         "--topk/--sweep")
    if getattr(args, "steps", None) not in (None, args.k):
        raise UsageError(f"--engine vllm: --steps {args.steps} and --k {args.k} disagree (vLLM drafts --k tokens)")
    engine = vllm_args.engine_from_args(args)
    if int(engine.get("data_parallel_size") or 1) > 1:
        raise UsageError("--engine vllm decodes one prompt at a time (the latency speculative decoding is for): "
                         "--data-parallel-size has nothing to spread; use --tensor-parallel-size (with "
                         "--enable-expert-parallel for a MoE verifier)")
    vllm_python()  # fail first, in one line, when vLLM is not installed
    kind = checkpoint_kind(resolve_drafter(args.drafter, args.revision))  # its config.json says eagle3 or dflash
    prompts, name = load_prompts(args.prompts, args.num_prompts)  # then when the prompt set is missing
    cpu = vllm_args.on_cpu(args.vllm_device)
    layout, dtype = engine_layout(args.vllm_engines, cpu), default_dtype(args.torch_dtype, cpu)
    debug = debug_requested()
    verifier_path = resolve_verifier(args.verifier)
    tokenizer = use_chat_template(load_tokenizer(args.verifier, revision=args.verifier_revision), args.chat_template)
    drafter: Any = kind.model_class().from_pretrained(args.drafter, revision=args.revision, dtype=dtype)
    vconfig = load_config(verifier_path, revision=args.verifier_revision)
    for warning in check_pair(vconfig, drafter, tokenizer):  # a mismatch is one line before vLLM even starts
        print(f"WARNING: {warning}", file=sys.stderr)
    ids = [render_prompt(tokenizer, [{"role": "user", "content": (prompt_turns(p) or [""])[0]}], drafter_mode(drafter))
           for p in prompts]
    threads = torch.get_num_threads()
    # the context a prompt needs: itself, its answer and the drafts past the answer's end
    max_model_len = args.max_model_len or max(len(i) for i in ids) + args.max_new_tokens + args.k + 1
    engine["trust_remote_code"] = trusted()
    request = GenerationRequest(verifier=verifier_path, verifier_revision=args.verifier_revision, prompts=ids,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                                dtype=dtype, max_model_len=max_model_len, k=args.k,
                                logprobs=2 if args.temperature <= 0 else None, engine=engine,
                                method=kind.vllm_method)
    print(f"vLLM: {len(ids)} prompts, plain and with the {kind.label} drafter {args.drafter} (k={args.k}, {dtype}), "
          f"{layout_line(layout, engine, cpu)} ...", file=sys.stderr)
    result = run_engines(request, args.drafter, args.revision, layout, cpu, threads=threads, debug=debug)
    plain, spec = result["plain"], dict(result["spec"], vllm_version=result["vllm_version"])
    summary = summarize(plain, spec, args.k, args.temperature, args.max_new_tokens)
    summary.update(prompts=name, num_prompts=len(ids), max_new_tokens=args.max_new_tokens, verifier=args.verifier,
                   drafter=args.drafter, drafter_kind=kind.name, vllm_method=kind.vllm_method, threads=threads,
                   dtype=dtype, engines=layout, vllm_engine=vllm_args.llm_kwargs(engine, cpu))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if not args.skip_transformers:
        from .evaluate import evaluate_drafter, place_verifier

        verifier, device = place_verifier(args, dtype)  # after vLLM has exited: its GPUs are free again
        drafter.to(device)
        drafter.load_verifier_embeddings(verifier)
        ours = evaluate_drafter(verifier, drafter, tokenizer, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, seed=args.seed, prompts_name=name,
                                progress=not args.no_progress)
        ours.update(verifier=args.verifier, drafter=args.drafter)
        written += list(write_outputs(out, ours))
        summary.update(compare_engines(summary, ours, steps="accepted_per_step_cut"))
    else:  # nothing in-process to compare with: compare with what training recorded instead
        against = served_against_training(summary, args.drafter, args.revision)
        if against:
            print(against, file=sys.stderr)
    json_path = out / VLLM_EVALUATION_FILE
    json_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    written.append(json_path)
    if args.write_to_drafter:  # only vLLM's file: the drafter's own eagle3_evaluation.json stays evaluate's
        copy_to_drafter(json_path, args.drafter)
    print(f"{format_vllm_summary(summary)}\nwrote {', '.join(str(p) for p in written)}")
    return 1 if summary["lossless"] is False else 0
