"""τ at long context, full attention against a sliding window: the long-context table of docs/results/eagle31.md.

The drafters trained on 256-token rows (the demo's recipe) decode prompts of at least 2,048 tokens: transcripts
of chitchat conversations (the training prompts are short single turns, so these were never trained on) ending
in a question about them. Each drafter decodes them with full attention and with the attention of the last
`--window` tokens (`sliding_window`, the same weights), chain k = 3, 64 tokens, greedy; the same again on all 80
MT-bench questions (27 to 402 prompt tokens, 100 on average: a 256-token window binds only on the longest). One
JSON per run beside experiments/eagle31.py's (its MT-bench full-attention chain is reused):

    .venv/bin/python -m experiments.long_context --out runs/eagle31/decode \
        --drafters runs/eagle31/eagle3.0-seed0 runs/eagle31/eagle3.0-seed1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from experiments.eagle31 import write_between_markers

VERIFIER = "smollm2-135m-instruct"
QUESTIONS = ["Summarize the conversations above in a few sentences.",
             "Which topics came up in the conversations above? List them.",
             "Pick one of the conversations above and describe how it went.",
             "What did the speakers in the conversations above agree or disagree about?"]


def long_prompts(tokenizer, count: int, min_tokens: int) -> list[dict]:
    """`count` prompts of at least `min_tokens` tokens (chat template included), each from its own chitchat
    conversations, taken from the end of the dataset."""
    from eagle3_hf.demo_data.prompts import chitchat_conversations
    from eagle3_hf.evaluation.evaluate import render_prompt

    conversations = list(chitchat_conversations())[::-1]
    prompts, lines = [], []
    for conv in conversations:
        lines += [f"{'A' if m['role'] == 'user' else 'B'}: {m['content']}" for m in conv["messages"]] + [""]
        text = "Here are some chat conversations.\n\n" + "\n".join(lines) + "\n" + QUESTIONS[len(prompts) % 4]
        if len(render_prompt(tokenizer, [{"role": "user", "content": text}])) >= min_tokens:
            prompts.append({"id": f"long-{len(prompts)}", "turns": [text]})
            lines = []
            if len(prompts) == count:
                return prompts
    raise SystemExit(f"the chitchat data holds only {len(prompts)} prompts of {min_tokens} tokens")


def decode(drafter_dir: Path, out: Path, window: int, count: int, min_tokens: int) -> None:
    import torch

    from eagle3_hf.decoding import speculative_decode
    from eagle3_hf.evaluation.evaluate import load_prompts, render_prompt
    from eagle3_hf.model.modeling_eagle3 import Eagle3DraftModel
    from eagle3_hf.verifier.loading import load_tokenizer, load_verifier

    torch.set_num_threads(1)
    verifier = load_verifier(VERIFIER, dtype=torch.float32)
    tokenizer = load_tokenizer(VERIFIER)
    drafter = Eagle3DraftModel.from_pretrained(drafter_dir, verifier=verifier).eval()
    sets = {"long": long_prompts(tokenizer, count, min_tokens), "mt-bench": load_prompts("mt-bench")[0]}
    out.mkdir(parents=True, exist_ok=True)
    for name, prompts in sets.items():
        ids = [render_prompt(tokenizer, [{"role": "user", "content": p["turns"][0]}]) for p in prompts]
        for w in (None, window):
            # the MT-bench full-attention chain is experiments/eagle31.py's own run, under its name
            shared = (name, w) == ("mt-bench", None)
            path = out / ("S3-K1-N4-chain.json" if shared else f"{name}-chain-w{w or 'full'}.json")
            if path.exists():
                continue
            drafter.config.sliding_window = w
            started, accepted, steps, tokens = time.perf_counter(), 0, 0, []
            for prompt in ids:
                result = speculative_decode(verifier, drafter, prompt, steps=3, max_new_tokens=64,
                                            eos_token_id=tokenizer.eos_token_id)
                accepted += sum(result.accepted_per_step)
                steps += len(result.accepted_per_step)
                tokens.append(result.tokens)
            row = {"prompts_set": name, "window": w, "steps": 3, "topk": 1, "num_draft_tokens": 4, "rule": "chain",
                   "tau": (accepted + steps) / steps, "verify_steps": steps, "prompts": len(ids),
                   "prompt_tokens": [min(map(len, ids)), max(map(len, ids))], "max_new_tokens": 64,
                   "seconds": round(time.perf_counter() - started, 1),
                   "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}
            path.write_text(json.dumps(row) + "\n", encoding="utf-8")
            print(json.dumps(row), flush=True)


def table(drafters: list[Path], out: Path, window: int) -> str:
    lines = ["| drafter | prompts | prompt tokens | τ full attention | τ window " + str(window)
             + " | window − full | answers identical |", "|---|---|---|---|---|---|---|"]
    for d in drafters:
        runs = out / d.name
        for name, label in (("mt-bench", "MT-bench"), ("long", "long transcripts")):
            full = json.loads((runs / ("S3-K1-N4-chain.json" if name == "mt-bench" else "long-chain-wfull.json"))
                              .read_text())
            win = json.loads((runs / f"{name}-chain-w{window}.json").read_text())
            tokens = win["prompt_tokens"]
            lines.append(f"| {d.name} | {label} ({win['prompts']}) | {tokens[0]:,}–{tokens[1]:,} | {full['tau']:.3f} | "
                         f"{win['tau']:.3f} | {win['tau'] - full['tau']:+.3f} | "
                         f"{'yes' if full['tokens_sha256'] == win['tokens_sha256'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", type=Path, nargs="+", default=[])
    parser.add_argument("--out", type=Path, default=Path("runs/eagle31/decode"))
    parser.add_argument("--window", type=int, default=256, help="the training rows' length (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--min-tokens", type=int, default=2048)
    parser.add_argument("--table", nargs="?", const="-", default=None, metavar="PAGE",
                        help="print the table of finished runs, and write it between the markers of PAGE")
    parser.add_argument("--windowed-copy", type=Path, nargs=2, default=None, metavar=("DRAFTER", "OUT"),
                        help="save DRAFTER with --window in its config (for `evaluate --engine vllm`) and stop")
    parser.add_argument("--write-prompts", type=Path, default=None,
                        help="write the long prompts as JSONL (`eagle3-hf evaluate --prompts FILE`) and stop")
    parser.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)  # a worker: one drafter
    args = parser.parse_args()
    if args.table:
        text = table(args.drafters, args.out, args.window)
        print(text)
        if args.table != "-":
            write_between_markers(Path(args.table), "long-context-table", text)
        return
    if args.windowed_copy:
        from eagle3_hf.model.modeling_eagle3 import Eagle3DraftModel

        drafter = Eagle3DraftModel.from_pretrained(args.windowed_copy[0])
        drafter.config.sliding_window = args.window
        drafter.save_pretrained(args.windowed_copy[1])
        return
    if args.write_prompts:
        from eagle3_hf.verifier.loading import load_tokenizer

        rows = long_prompts(load_tokenizer(VERIFIER), args.prompts, args.min_tokens)
        args.write_prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return
    if args.one:
        decode(args.one, args.out / args.one.name, args.window, args.prompts, args.min_tokens)
        return
    procs = [subprocess.Popen([sys.executable, "-m", "experiments.long_context", "--drafters", *map(str, args.drafters),
                               "--out", str(args.out), "--window", str(args.window), "--prompts", str(args.prompts),
                               "--min-tokens", str(args.min_tokens), "--one", str(d)]) for d in args.drafters]
    if any(p.wait() for p in procs):
        raise SystemExit("a decoding process failed (its output is above)")


if __name__ == "__main__":
    main()
