"""Build "next versions" of a verifier (continued training on other text) and measure how far they drifted.

    # two drift strengths of the embedded default, cached under ~/.cache/eagle3_hf; re-running reuses them
    python -m experiments.drift_verifiers --steps 4 16 --output drift.json
    # measured on the drafter's own data (a prepared dataset) instead of held-out chitchat dialogues
    python -m experiments.drift_verifiers --steps 4 16 --prepared-dir demo_out/small/prepared --output drift.json

Prints one JSON line per drifted verifier: its directory (pass it as `--verifier` to extract/train a drafter
for that version), greedy agreement and KL against the original, cosine of the aux hidden states, and the
relative weight change. Not part of `make demo`: on 2 CPU cores each optimizer step takes tens of seconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle3_hf.verifier.loading import DEFAULT_VERIFIER, load_tokenizer, load_verifier

from experiments.drift import DriftRecipe, build_drifted_verifiers, drift_texts, measure_drift, weight_change


def held_out(args) -> list:
    if args.prepared_dir:
        from eagle3_hf.data.prepared_format import load_prepared

        ds, _meta = load_prepared(args.prepared_dir)
        return [row for row in ds["input_ids"][: args.held_out]]
    tokenizer = load_tokenizer(args.base)
    return [tokenizer.apply_chat_template(m, tokenize=True, return_dict=False)[: args.seq_len]
            for m in drift_texts(start=1000, limit=args.held_out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default=DEFAULT_VERIFIER)
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 16], help="drift strengths (optimizer steps)")
    parser.add_argument("--lr", type=float, default=DriftRecipe.lr)
    parser.add_argument("--warmup", type=int, default=DriftRecipe.warmup)
    parser.add_argument("--seq-len", type=int, default=DriftRecipe.seq_len)
    parser.add_argument("--batch-size", type=int, default=DriftRecipe.batch_size)
    parser.add_argument("--seed", type=int, default=DriftRecipe.seed)
    parser.add_argument("--prepared-dir", help="measure on these samples (default: held-out chitchat dialogues)")
    parser.add_argument("--held-out", type=int, default=12, help="sequences to measure the drift on")
    parser.add_argument("--output", type=Path, help="also write the measurements here (JSON)")
    args = parser.parse_args()
    recipe = DriftRecipe(lr=args.lr, warmup=args.warmup, seq_len=args.seq_len, batch_size=args.batch_size,
                         seed=args.seed)
    paths = build_drifted_verifiers(args.base, args.steps, recipe)
    original = load_verifier(args.base)
    sequences = held_out(args)
    results = {}
    for steps, path in paths.items():
        drifted = load_verifier(str(path))
        results[steps] = {"steps": steps, "lr": args.lr, "dir": str(path),
                          "weight_change": weight_change(original, drifted),
                          **measure_drift(original, drifted, sequences)}
        print(json.dumps(results[steps]))
        del drifted
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
