"""τ of SGLang's tree drafting under both attention rules, on every MT-bench question: docs/results/tree_drafting.md.

SGLang drafts a tree as K decode requests ("slots") whose KV entries are never reordered when the parents are
re-chosen, so from the third step on a node attends to its slot's earlier nodes, not its ancestors
(`--tree-attention sglang`); an engine with correct tree attention would use the ancestors (`ancestors`). Both
decode losslessly; only τ differs. This decodes the demo's drafter (greedy) for each (S, K, N) under both rules,
plus the chain, and writes one JSON line per run (a rerun skips what is done; `--shard i/n` splits the runs
between processes, one per core):

    .venv/bin/python -m experiments.tree_attention --drafter demo_out/small/drafter --out runs/tree_attention \
        --shard 0/2 &  .venv/bin/python -m experiments.tree_attention ... --shard 1/2
    .venv/bin/python -m experiments.tree_attention --drafter demo_out/small/drafter --out runs/tree_attention --table
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

STEPS, TOPK, SIZES = (3, 5), (2, 4), (4, 8, 16)
RULES = ("sglang", "ancestors")


def runs(steps=STEPS, topks=TOPK, sizes=SIZES) -> list[dict]:
    """The chain of each S, then every (S, K, N) under both rules."""
    out = [{"steps": s, "topk": 1, "num_draft_tokens": s + 1, "rule": "chain"} for s in steps]
    out += [{"steps": s, "topk": k, "num_draft_tokens": n, "rule": rule}
            for s in steps for k in topks for n in sizes for rule in RULES]
    return out


def _name(run: dict) -> str:
    return f"S{run['steps']}-K{run['topk']}-N{run['num_draft_tokens']}-{run['rule']}"


def decode_all(drafter_dir: str, verifier_name: str, todo: list[dict], out: Path, max_new_tokens: int,
               num_prompts: int | None) -> None:
    import torch

    from eagle3_hf.decoding import speculative_decode
    from eagle3_hf.evaluation.evaluate import load_prompts, render_prompt
    from eagle3_hf.model.modeling_eagle3 import Eagle3DraftModel
    from eagle3_hf.verifier.loading import load_tokenizer, load_verifier

    torch.set_num_threads(1)
    verifier = load_verifier(verifier_name, dtype=torch.float32)
    tokenizer = load_tokenizer(verifier_name)
    drafter = Eagle3DraftModel.from_pretrained(drafter_dir, verifier=verifier).eval()
    prompts, _ = load_prompts("mt-bench", num_prompts)
    ids = [render_prompt(tokenizer, [{"role": "user", "content": p["turns"][0]}]) for p in prompts]
    for run in todo:
        path = out / f"{_name(run)}.json"
        if path.exists():
            continue
        started, accepted, steps, tokens = time.perf_counter(), 0, 0, []
        for prompt in ids:
            kwargs = {} if run["topk"] == 1 else {"tree_attention": run["rule"]}
            result = speculative_decode(verifier, drafter, prompt, steps=run["steps"], topk=run["topk"],
                                        num_draft_tokens=run["num_draft_tokens"], max_new_tokens=max_new_tokens,
                                        eos_token_id=tokenizer.eos_token_id, **kwargs)
            accepted += sum(result.accepted_per_step)
            steps += len(result.accepted_per_step)
            tokens.append(result.tokens)
        row = {**run, "tau": (accepted + steps) / steps, "verify_steps": steps, "prompts": len(ids),
               "max_new_tokens": max_new_tokens, "seconds": round(time.perf_counter() - started, 1),
               "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}
        path.write_text(json.dumps(row) + "\n", encoding="utf-8")
        print(json.dumps(row), flush=True)


def table(out: Path) -> str:
    """The docs table: τ under each rule and the difference, per configuration."""
    rows = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    lines = ["| S | K | N | τ, SGLang's rule | τ, ancestors | ancestors − SGLang |", "|---|---|---|---|---|---|"]
    for run in runs():
        if run["rule"] == "chain":
            r = rows.get(_name(run))
            if r:
                lines.append(f"| {run['steps']} | 1 | {run['steps'] + 1} | {r['tau']:.3f} (chain) | same | 0 |")
            continue
        if run["rule"] != "sglang":
            continue
        a, b = rows.get(_name(run)), rows.get(_name({**run, "rule": "ancestors"}))
        if a and b:
            lines.append(f"| {run['steps']} | {run['topk']} | {run['num_draft_tokens']} | {a['tau']:.3f} | "
                         f"{b['tau']:.3f} | {b['tau'] - a['tau']:+.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=None, help="default: all 80 MT-bench questions")
    parser.add_argument("--shard", default="0/1", help="i/n: this process runs every n-th run from the i-th")
    parser.add_argument("--only", nargs="*", default=None, help="run names to run (e.g. S5-K4-N16-sglang)")
    parser.add_argument("--table", action="store_true", help="print the docs table from what is done")
    args = parser.parse_args()
    if args.table:
        print(table(args.out))
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    index, count = (int(x) for x in args.shard.split("/"))
    todo = [r for r in runs() if args.only is None or _name(r) in args.only]
    decode_all(args.drafter, args.verifier, todo[index::count], args.out, args.max_new_tokens, args.num_prompts)


if __name__ == "__main__":
    main()
