"""`eagle3-hf evaluate --sweep`: which SGLang configuration (S steps, top-K, N draft tokens) to serve a drafter with.

Each valid (S, K, N) of a small grid is evaluated as `evaluate` does (plain and speculative decoding of every
prompt, timed back to back; K = 1 is the chain, K > 1 the tree of tree.py, drafted under `--tree-attention`),
`--sweep-repeats` times, the configurations interleaved. The table gives τ, per-depth acceptance, the verify
cost (median seconds of a verifier forward over N tokens relative to a one-token forward at the same context)
and the speedup with its 95 % interval (recommend.py); with `--verify-costs FILE` (a table measured on the
machine that will serve, e.g. a GPU) also the speedup predicted there. The recommendation — one function,
`recommend.recommend`, whose answer the table, eagle3_sweep.json, the demo summary and the model card print —
says which evidence it rests on.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..constants import SWEEP_FILE
from ..errors import UsageError
from .recommend import predicted_speedup, recommend, speedup_interval

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..model.modeling_eagle3 import Eagle3DraftModel

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


def _is_mla(verifier: PreTrainedModel) -> bool:
    return getattr(verifier.config.get_text_config(), "kv_lora_rank", None) is not None


def run_sweep(verifier: PreTrainedModel, drafter: Eagle3DraftModel, tokenizer: PreTrainedTokenizerBase,
              prompts: Sequence[dict | str], grid: Sequence[dict[str, int]], max_new_tokens: int = 64,
              temperature: float = 0.0, seed: int = 0, prompts_name: str = "custom", output: str | Path | None = None,
              progress: bool = True, tree_attention: str = "sglang", repeats: int = 1,
              costs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate every configuration of `grid` on `prompts`, `repeats` rounds; -> the sweep (also written to
    output/eagle3_sweep.json after every configuration, so an interrupted sweep keeps what it measured)."""
    from tqdm.auto import tqdm

    from ..decoding.tree import verify_costs
    from .evaluate import drafter_mode, evaluate_drafter, render_prompt

    if not grid:
        raise ValueError("the sweep grid holds no valid (steps, topk, num_draft_tokens) configuration")
    if repeats < 1:
        raise ValueError(f"--sweep-repeats must be >= 1, not {repeats}")
    first = prompts[0] if isinstance(prompts[0], str) else (prompts[0].get("turns") or [prompts[0].get("prompt")])[0]
    measured_costs = verify_costs(verifier, render_prompt(tokenizer, [{"role": "user", "content": first}],
                                                          drafter_mode(drafter)),
                                  sorted({c["num_draft_tokens"] for c in grid}))
    rows: list[dict] = [dict(config) for config in grid]
    pairs: list[list[tuple[float, float]]] = [[] for _ in grid]
    meta = {"prompts": prompts_name, "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "temperature": temperature, "device": str(verifier.device), "tree_attention": tree_attention,
            "repeats": repeats, "mla": _is_mla(verifier)}
    result: dict[str, Any] = {}
    for rep in range(repeats):
        for i, config in enumerate(tqdm(grid, desc=f"sweep {rep + 1}/{repeats}", unit="config",
                                        disable=not progress)):
            summary = evaluate_drafter(verifier, drafter, tokenizer, prompts, k=config["steps"], topk=config["topk"],
                                       num_draft_tokens=config["num_draft_tokens"], max_new_tokens=max_new_tokens,
                                       temperature=temperature, seed=seed, prompts_name=prompts_name, progress=False,
                                       tree_attention=tree_attention)
            pairs[i] += [(r["baseline_seconds"], r["speculative_seconds"]) for r in summary["per_prompt"]]
            plain, spec = [p for p, _ in pairs[i]], [s for _, s in pairs[i]]
            low, high = speedup_interval(plain, spec)
            rows[i].update({"acceptance_length": summary["acceptance_length"],
                            "per_depth_acceptance": summary["per_position_acceptance"],
                            "verify_cost": measured_costs[config["num_draft_tokens"]],
                            "speedup": sum(plain) / sum(spec), "speedup_low": low, "speedup_high": high,
                            "timed_pairs": len(pairs[i]), "tokens_per_second": summary["tokens_per_second"],
                            "lossless": summary["lossless"] if rows[i].get("lossless") is not False else False,
                            "mismatches": summary["mismatches"], "numerical_ties": summary["numerical_ties"]})
            if costs is not None:
                rows[i]["predicted_speedup"] = predicted_speedup(summary["acceptance_length"], config["steps"],
                                                                 config["topk"], config["num_draft_tokens"], costs)
            result = summarise([r for r in rows if "acceptance_length" in r], meta, costs)
            if output is not None:
                out = Path(output)
                out.mkdir(parents=True, exist_ok=True)
                (out / SWEEP_FILE).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def summarise(rows: list[dict], meta: dict[str, Any], costs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sweep's JSON: every row, the recommendation (and its basis), the tree the same rule ranks first
    (what the demo decodes on MT-bench) and the chain for vLLM, which drafts chains."""
    rec = recommend(rows, costs)
    trees, chains = [r for r in rows if r["topk"] > 1], [r for r in rows if r["topk"] == 1]
    best_tree = recommend(trees, costs).as_dict(meta.get("mla", False)) if trees else None
    chain = recommend(chains, costs) if chains else None
    mla = meta.get("mla", False)
    basis = (f"predicted from the verify costs in {costs['source']} ({costs['device']})" if costs else
             "measured on this machine")
    return {**meta, "configs": rows, "speed_basis": basis,
            "recommendation": rec.as_dict(mla), "sglang_flags": rec.sglang_flags(mla),
            "best_tree": best_tree, "vllm_num_speculative_tokens": chain.steps if chain else None,
            "vllm_reason": chain.reason if chain else None}


def _num(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_sweep(result: dict[str, Any]) -> str:
    """The table, the recommendation with its evidence, and the flags that serve it."""
    lines = [f"sweep on {result['prompts']} ({result['num_prompts']} prompts x {result['max_new_tokens']} tokens, "
             f"{result.get('repeats', 1)} round(s), T={result['temperature']}, {result['device']}, tree attention "
             f"{result.get('tree_attention', 'sglang')}); speed "
             f"{result.get('speed_basis', 'measured on this machine')}",
             f"{'S':>2} {'K':>2} {'N':>3} {'tau':>5}  {'per-depth acceptance':<32} {'verify/t1':>9} "
             f"{'speedup [95% interval]':>24} {'predicted':>9}  lossless"]
    for r in result["configs"]:
        depth = " ".join(_num(a) for a in r["per_depth_acceptance"])
        interval = f"{_num(r['speedup'])}x [{_num(r.get('speedup_low'))}, {_num(r.get('speedup_high'))}]"
        predicted = _num(r.get("predicted_speedup")) + "x" if r.get("predicted_speedup") is not None else "-"
        lines.append(f"{r['steps']:>2} {r['topk']:>2} {r['num_draft_tokens']:>3} {_num(r['acceptance_length']):>5}  "
                     f"{depth:<32} {_num(r['verify_cost']):>9} {interval:>24} {predicted:>9}  {r['lossless']}")
    rec = result["recommendation"]
    lines.append(f"recommended: S={rec['steps']} K={rec['topk']} N={rec['num_draft_tokens']} ({rec['basis']}: "
                 f"{rec['reason']})")
    lines.append(f"SGLang: {result['sglang_flags']}")
    if result.get("vllm_num_speculative_tokens"):
        lines.append(f"vLLM (chain): num_speculative_tokens {result['vllm_num_speculative_tokens']} "
                     f"({result['vllm_reason']})")
    return "\n".join(lines)


def run_cli(args) -> int:
    """`evaluate --sweep`: every valid configuration of the grid, the recommendation as SGLang flags."""
    from .evaluate import copy_to_drafter, load_for_evaluation

    grid = sweep_grid(args.sweep_steps or DEFAULT_STEPS, args.sweep_topk or DEFAULT_TOPK,
                      args.sweep_num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS)
    if not grid:
        raise UsageError("--sweep-steps/--sweep-topk/--sweep-num-draft-tokens: no valid configuration in the grid")
    from .recommend import load_verify_costs

    costs = load_verify_costs(args.verify_costs) if args.verify_costs else None  # before the models load
    verifier, drafter, tokenizer, prompts, name = load_for_evaluation(args)
    result = run_sweep(verifier, drafter, tokenizer, prompts, grid, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, seed=args.seed, prompts_name=name, output=args.output,
                       progress=not args.no_progress, tree_attention=args.tree_attention,
                       repeats=args.sweep_repeats, costs=costs)
    path = Path(args.output) / SWEEP_FILE
    if args.write_to_drafter:
        copy_to_drafter(path, args.drafter)
    print(f"{format_sweep(result)}\nwrote {path}")
    return 1 if any(r["lossless"] is False for r in result["configs"]) else 0
