"""The verifier's greedy head at Kimi-K2.5's shape (hidden 7168, vocabulary 163,840): seconds per 1,000 tokens of
the fp32 CPU head the vLLM routes used before (a [c, V] fp32 logits chunk per 409 positions, then argmax) against
verifier/greedy.py's path on this CPU, fp32 and bf16 (fp32 rescoring), timed alternately, median of repeats.
Prints the CPU's matrix flags (bf16 pays on a CPU only with AMX / AVX-512 BF16) and the agreement of each path
with the fp32 reference.

    python -m bench.greedy_head [--tokens 256] [--repeats 3] [--hidden 7168] [--vocab 163840] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from eagle3_hf.verifier.greedy import cpu_flags, greedy_argmax, head_dtype


def matrix_flags() -> list[str]:
    """The matrix-relevant flags of this CPU."""
    return sorted(f for f in cpu_flags() if f.startswith(("avx512_bf16", "amx", "avx512f", "avx2", "avx512_fp16")))


def before(weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The previous capture.greedy_tokens on an fp32 head: rows chunked to 64 M logits, whole vocabulary at once."""
    chunk = max(1, (1 << 26) // weight.shape[0])
    return torch.cat([(h[s:s + chunk] @ weight.T).argmax(-1) for s in range(0, h.shape[0], chunk)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--vocab", type=int, default=163840)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    w_bf16 = (torch.randn(args.vocab, args.hidden) * 0.02).bfloat16()  # checkpoints store the head in bf16
    w_fp32 = w_bf16.float()
    h = torch.randn(args.tokens, args.hidden) * 2
    paths = {"fp32_cpu_before": lambda: before(w_fp32, h), "fp32_cpu_chunked": lambda: greedy_argmax(w_fp32, h),
             "bf16_cpu_rescored": lambda: greedy_argmax(w_bf16, h)}
    times: dict[str, list[float]] = {k: [] for k in paths}
    out: dict[str, torch.Tensor] = {}
    for name, fn in paths.items():  # warm-up
        out[name] = fn()
    for _ in range(args.repeats):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ref = out["fp32_cpu_before"]
    per_1k = {k: round(statistics.median(v) * 1000 / args.tokens, 2) for k, v in times.items()}
    print(json.dumps({
        "shape": {"hidden": args.hidden, "vocab": args.vocab, "tokens_timed": args.tokens},
        "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": matrix_flags(), "cpu_default_head_dtype": str(head_dtype(torch.device("cpu"))),
        "seconds_per_1000_tokens": per_1k,
        "speedup_over_before": {k: round(per_1k["fp32_cpu_before"] / v, 2) for k, v in per_1k.items()},
        "agreement_with_fp32": {k: round(float((v == ref).float().mean()), 5) for k, v in out.items()},
        "head_bytes": {"fp32": w_fp32.numel() * 4, "bf16": w_bf16.numel() * 2},
    }, indent=1))


if __name__ == "__main__":
    main()
