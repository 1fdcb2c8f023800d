"""Regeneration benchmark on the real default verifier (SmolLM2-135M), ratios measured in one run.

- `ratio_features_over_bare_forward` (goal >= 0.8): tokens/s of `regenerate --features-out` (generate answers,
  capture aux/final states and greedy tokens, write shards, JSONL and the prepared dataset) over tokens/s of a
  bare batched forward over the very same sequences: `model(input_ids, attention_mask).logits.argmax(-1)` on
  the same length-sorted batches, right-padded, no cache, no hooks, nothing written, with the same prepacked
  oneDNN linears (cpu_linear.py). That forward is the least any method pays to get every state and greedy
  token of those tokens; generation must also run token by token.
- `speedup_over_before`: the same prompts through what the demo ran before, `regenerate` (transformers
  `generate`, batched) + `prepare` + `extract`, tokens/s of prepared tokens over the same wall time.
- with `--workers`: the CLI run as 2 processes x 1 thread and as 1 process x 2 threads (tokens/s each).

    python -m bench.regenerate [--prompts 32] [--max-new-tokens 64] [--batch-size 64] [--threads 1] [--workers]

Tokens counted are sample tokens (prompt + answer + template tail), the unit training consumes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """Wall seconds and this process's CPU seconds (all its threads): on a shared, oversubscribed machine the
    CPU seconds measure the work, the wall seconds also the neighbours."""

    def __enter__(self):
        self.w, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.w, time.process_time() - self.c


def _features_pass(prompts, backend, work: Path, batch_size: int) -> tuple[Clock, int, Path]:
    from eagle3_hf.data.regenerate import RegenerateOutputs
    from eagle3_hf.features.transformers_generation import regenerate_with_features

    with Clock() as clock:
        summary = regenerate_with_features(prompts, RegenerateOutputs(work / "c.jsonl", work / "f", work / "prep"),
                                           backend, batch_size=batch_size, progress=False)
    return clock, summary.written_tokens, work / "prep"


def _bare_forward(model, samples: list[list[int]], batch_size: int, pad: int) -> Clock:
    from eagle3_hf.verifier.cpu_linear import prepacked_linears

    order = sorted(samples, key=len, reverse=True)
    with torch.inference_mode(), prepacked_linears(model):
        model(input_ids=torch.tensor([order[-1]]))  # the weights are packed once, outside the clock
    with Clock() as clock, torch.inference_mode(), prepacked_linears(model):
        for i in range(0, len(order), batch_size):
            batch = order[i:i + batch_size]
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for k, s in enumerate(batch):
                ids[k, :len(s)], mask[k, :len(s)] = torch.tensor(s), 1
            model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    return clock


def _before(prompts, backend, work: Path, batch_size: int) -> tuple[Clock, int]:
    from eagle3_hf.data.conversations import load_conversations
    from eagle3_hf.data.fingerprint import tokenizer_fingerprint
    from eagle3_hf.data.prepare import build_meta, new_stats, prepare_conversations
    from eagle3_hf.data.prepared_format import save_prepared
    from eagle3_hf.data.regenerate import regenerate
    from eagle3_hf.features.routes.transformers import extract_features

    work.mkdir(parents=True)
    with Clock() as clock:
        regenerate(prompts, work / "c.jsonl", backend, batch_size=batch_size, progress=False)
        stats = new_stats()
        ds = prepare_conversations(load_conversations(str(work / "c.jsonl")), backend.tokenizer, stats=stats)
        save_prepared(ds, work / "prep", build_meta(backend.tokenizer, backend.name, stats, {}))
        extract_features(backend.model, tokenizer_fingerprint(backend.tokenizer), work / "prep", work / "f",
                         progress=False)
    return clock, stats["tokens"]


def _cli_run(prompts_file: Path, work: Path, max_new: int, batch_size: int, workers: int, threads: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "eagle3_hf.cli", "regenerate", "--input", str(prompts_file), "--output",
           str(work / "c.jsonl"), "--verifier", "smollm2-135m-instruct", "--max-new-tokens", str(max_new),
           "--batch-size", str(batch_size), "--features-out", str(work / "f"), "--num-workers", str(workers)]
    err = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stderr
    return float(re.search(r"\(([\d.]+) tok/s", err).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--before-batch-size", type=int, default=16, help="what the demo's regenerate used before")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each is kept")
    parser.add_argument("--workers", action="store_true", help="also time 2 processes x 1 thread vs 1 x 2 threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from eagle3_hf.data.regenerate_backends import TransformersBackend
    from eagle3_hf.demo_data.prompts import short_prompts

    prompts = short_prompts(args.prompts)
    backend = TransformersBackend("smollm2-135m-instruct", device="cpu", max_new_tokens=args.max_new_tokens)
    rates: dict[str, list[tuple[float, float]]] = {"features": [], "bare_forward": [], "before": []}

    def rate(kind: str, clock: Clock, tokens: int) -> None:
        rates[kind].append((tokens / clock.wall, tokens / clock.cpu))

    import datasets

    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            clock, tokens, prep = _features_pass(prompts, backend, Path(tmp) / f"feat{r}", args.batch_size)
            rate("features", clock, tokens)
            samples = datasets.load_from_disk(str(prep))["input_ids"]
            rate("bare_forward", _bare_forward(backend.model, samples, args.batch_size, backend.pad),
                 sum(map(len, samples)))
            clock, tokens = _before(prompts, backend, Path(tmp) / f"before{r}", args.before_batch_size)
            rate("before", clock, tokens)
        best = {k: (max(w for w, _ in v), max(c for _, c in v)) for k, v in rates.items()}
        result = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                  "before_batch_size": args.before_batch_size, "threads": args.threads,
                  "sample_tokens": sum(map(len, samples)),
                  **{f"{k}_tok_s": round(w, 1) for k, (w, _) in best.items()},
                  **{f"{k}_tok_per_cpu_s": round(c, 1) for k, (_, c) in best.items()},
                  "ratio_features_over_bare_forward": round(best["features"][0] / best["bare_forward"][0], 3),
                  "ratio_features_over_bare_forward_cpu": round(best["features"][1] / best["bare_forward"][1], 3),
                  "speedup_over_before": round(best["features"][0] / best["before"][0], 2),
                  "speedup_over_before_cpu": round(best["features"][1] / best["before"][1], 2)}
        if args.workers:
            from eagle3_hf.data.conversations import write_jsonl

            write_jsonl(Path(tmp) / "p.jsonl", prompts)
            runs = {"2x1": (2, 1), "1x2": (1, 2)}
            for name, (w, t) in runs.items():
                result[f"cli_{name}_tok_s"] = _cli_run(Path(tmp) / "p.jsonl", Path(tmp) / f"cli{name}",
                                                       args.max_new_tokens, args.batch_size, w, t)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
