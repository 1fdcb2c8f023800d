"""`eagle3-hf evaluate --sweep`: which SGLang configuration (S steps, top-K, N draft tokens) to serve a drafter with.

Each valid (S, K, N) of a small grid is evaluated as `evaluate` does (plain and speculative decoding of every
prompt, timed back to back; K = 1 is the chain, K > 1 the tree of tree.py). The table gives τ, per-depth
acceptance, the verify cost (median seconds of a verifier forward over N tokens relative to a one-token
forward at the same context) and the speedup; the fastest configuration is printed as SGLang flags, the fastest
chain as vLLM's num_speculative_tokens (vLLM drafts chains), and both go to eagle3_sweep.json, which the model
card reads (model_card.sweep_section).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from ..constants import SWEEP_FILE

DEFAULT_STEPS, DEFAULT_TOPK, DEFAULT_NUM_DRAFT_TOKENS = (2, 3, 5), (1, 2, 4, 8), (4, 8, 16)


def sweep_grid(steps: Sequence[int] = DEFAULT_STEPS, topks: Sequence[int] = DEFAULT_TOPK,
               sizes: Sequence[int] = DEFAULT_NUM_DRAFT_TOKENS) -> list[dict[str, int]]:
    """The valid configurations of the grid: K = 1 once per S with N = S + 1 (SGLang forces it), K > 1 with
    each N that SGLang accepts (2 <= N <= 1 + K + (S - 1) K^2)."""
    from ..decoding.tree import config_problem

    grid = []
    for s in steps:
        for k in topks:
            for n in ([s + 1] if k == 1 else sizes):
                config = {"steps": s, "topk": k, "num_draft_tokens": n}
                if config_problem(s, k, n) is None and config not in grid:
                    grid.append(config)
    return grid


def sglang_flags(config: dict[str, Any]) -> str:
    return (f"--speculative-algorithm EAGLE3 --speculative-num-steps {config['steps']} "
            f"--speculative-eagle-topk {config['topk']} --speculative-num-draft-tokens {config['num_draft_tokens']}")


def _fastest(rows: list[dict]) -> dict | None:
    timed = [r for r in rows if r.get("speedup") is not None]
    return max(timed, key=lambda r: (r["speedup"], r["acceptance_length"] or 0)) if timed else None


def run_sweep(verifier, drafter, tokenizer, prompts: Sequence[dict | str], grid: Sequence[dict[str, int]],
              max_new_tokens: int = 64, temperature: float = 0.0, seed: int = 0, prompts_name: str = "custom",
              output: str | Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Evaluate every configuration of `grid` on `prompts`; -> the sweep (written to output/eagle3_sweep.json)."""
    from tqdm.auto import tqdm

    from .evaluate import evaluate_drafter, render_prompt
    from ..decoding.tree import verify_costs

    if not grid:
        raise ValueError("the sweep grid holds no valid (steps, topk, num_draft_tokens) configuration")
    first = prompts[0] if isinstance(prompts[0], str) else (prompts[0].get("turns") or [prompts[0].get("prompt")])[0]
    costs = verify_costs(verifier, render_prompt(tokenizer, [{"role": "user", "content": first}]),
                         sorted({c["num_draft_tokens"] for c in grid}))
    rows: list[dict] = []
    for config in tqdm(grid, desc="sweep", unit="config", disable=not progress):
        summary = evaluate_drafter(verifier, drafter, tokenizer, prompts, k=config["steps"], topk=config["topk"],
                                   num_draft_tokens=config["num_draft_tokens"], max_new_tokens=max_new_tokens,
                                   temperature=temperature, seed=seed, prompts_name=prompts_name, progress=False)
        rows.append({**config, "acceptance_length": summary["acceptance_length"],
                     "per_depth_acceptance": summary["per_position_acceptance"],
                     "verify_cost": costs[config["num_draft_tokens"]], "speedup": summary["speedup"],
                     "tokens_per_second": summary["tokens_per_second"], "lossless": summary["lossless"],
                     "mismatches": summary["mismatches"], "numerical_ties": summary["numerical_ties"]})
        result = _summarise(rows, prompts_name, len(prompts), max_new_tokens, temperature, str(verifier.device))
        if output is not None:  # after every configuration: an interrupted sweep keeps what it measured
            out = Path(output)
            out.mkdir(parents=True, exist_ok=True)
            (out / SWEEP_FILE).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _summarise(rows: list[dict], prompts_name: str, num_prompts: int, max_new_tokens: int, temperature: float,
               device: str) -> dict[str, Any]:
    best, chain = _fastest(rows), _fastest([r for r in rows if r["topk"] == 1])
    return {
        "prompts": prompts_name, "num_prompts": num_prompts, "max_new_tokens": max_new_tokens,
        "temperature": temperature, "device": device, "configs": rows, "best": best,
        "best_chain": chain, "sglang_flags": sglang_flags(best) if best else None,
        "vllm_num_speculative_tokens": chain["steps"] if chain else None,
    }


def _num(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_sweep(result: dict[str, Any]) -> str:
    """The table, the fastest configuration and the flags that serve it."""
    lines = [f"sweep on {result['prompts']} ({result['num_prompts']} prompts x {result['max_new_tokens']} tokens, "
             f"T={result['temperature']}, {result['device']})",
             f"{'S':>2} {'K':>2} {'N':>3} {'tau':>5}  {'per-depth acceptance':<32} {'verify/t1':>9} {'speedup':>7}  lossless"]
    for r in result["configs"]:
        depth = " ".join(_num(a) for a in r["per_depth_acceptance"])
        lines.append(f"{r['steps']:>2} {r['topk']:>2} {r['num_draft_tokens']:>3} {_num(r['acceptance_length']):>5}  "
                     f"{depth:<32} {_num(r['verify_cost']):>9} {_num(r['speedup']) + 'x':>7}  {r['lossless']}")
    best, chain = result["best"], result["best_chain"]
    if best:
        lines.append(f"fastest: S={best['steps']} K={best['topk']} N={best['num_draft_tokens']} "
                     f"(tau {_num(best['acceptance_length'])}, {_num(best['speedup'])}x)")
        lines.append(f"SGLang: {result['sglang_flags']}")
    if chain:
        lines.append(f"vLLM (chain): num_speculative_tokens {result['vllm_num_speculative_tokens']} "
                     f"(tau {_num(chain['acceptance_length'])}, {_num(chain['speedup'])}x)")
    return "\n".join(lines)


def run_cli(args) -> int:
    """`evaluate --sweep`: every valid configuration of the grid, the fastest as SGLang flags."""
    from .evaluate import copy_to_drafter, load_for_evaluation

    grid = sweep_grid(args.sweep_steps or DEFAULT_STEPS, args.sweep_topk or DEFAULT_TOPK,
                      args.sweep_num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS)
    if not grid:
        raise SystemExit("--sweep-steps/--sweep-topk/--sweep-num-draft-tokens: no valid configuration in the grid")
    verifier, drafter, tokenizer, prompts, name = load_for_evaluation(args)
    result = run_sweep(verifier, drafter, tokenizer, prompts, grid, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, seed=args.seed, prompts_name=name, output=args.output,
                       progress=not args.no_progress)
    path = Path(args.output) / SWEEP_FILE
    if args.write_to_drafter:
        copy_to_drafter(path, args.drafter)
    print(f"{format_sweep(result)}\nwrote {path}")
    return 1 if any(r["lossless"] is False for r in result["configs"]) else 0
