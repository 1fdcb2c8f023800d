"""First-launch benchmark: shard hashing rates with 1 and N threads, and the time a training launch takes to finish
its first step on a freshly extracted feature directory, with and without hashing. Ratios from one run.

Writes `--gb` GB of synthetic features through the store's own writer (`ShardWriter`, as `extract` does: random bf16
states of a verifier with hidden `--hidden`, `--shard-mb` shards), saves a matching tiny verifier and a
vocabulary, then
- hashing: `verify_shards(mode="always")` over every shard at each thread count of `--threads`, alternated over
  `--repeats` rounds, warm (the page cache holds the shards) and cold (each shard's pages dropped first with
  posix_fadvise DONTNEED, so the bytes come from the disk); GB/s and each count's ratio over 1 thread;
- first launch: `eagle3-hf train --max-steps 1` in-process, cold, timed from the call to its return, with
  `--verify-features once` (the writer's checksums vouch for the shards: none hashed), `always` on 1 thread (every
  shard hashed single-threaded, as every first launch did before), and `always` on N threads (what a copied
  directory now costs once); the hashing's share is each launch minus the `once` launch.

    python -m bench.first_launch [--gb 3] [--hidden 1024] [--shard-mb 256] [--threads 1,2] [--repeats 2]

The directory is written under --dir (default: a temporary directory) and deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def drop_cache(paths: list[Path]) -> None:
    """Evict these files' clean pages, so the next read comes from the disk (no root needed, nothing else touched)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_features(root: Path, gb: float, hidden: int, shard_mb: int, tokens_per_sample: int = 1024) -> Path:
    """~`gb` GB of bf16 features of a 4-layer verifier with `hidden`, plus the verifier and a vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_hf.data.vocab import save_vocab, vocab_from_target_ids
    from eagle3_hf.features.records import make_header
    from eagle3_hf.features.shard_writer import ShardWriter
    from eagle3_hf.features.store import merge_manifests

    vocab, layers = 512, 4
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(root / "verifier")
    header = make_header({"name": str(root / "verifier"), "revision": None, "num_hidden_layers": layers,
                          "hidden_size": hidden, "vocab_size": vocab}, "bench-tokenizer", (1, 2, 3), "bfloat16")
    features = root / "features"
    per_token = 4 * hidden * 2 + 4 + 1 + 4  # three aux states and the last one in bf16, ids, mask, greedy
    samples = max(8, int(gb * 1e9 / (per_token * tokens_per_sample)))
    writer = ShardWriter(features, header, samples_per_shard=1 << 20, max_shard_bytes=shard_mb << 20)
    g = torch.Generator().manual_seed(0)
    n = tokens_per_sample
    for i in range(samples):
        aux = torch.randn(n, 3 * hidden, generator=g)
        writer.add(f"b{i:06d}", torch.randint(0, vocab, (n,), generator=g), (torch.arange(n) >= n // 4).long(), aux,
                   torch.randn(n, hidden, generator=g), torch.randint(0, vocab, (n,), generator=g))
    writer.close()
    merge_manifests(features)
    d2t, t2d = vocab_from_target_ids(torch.arange(vocab), vocab)
    save_vocab(features / "vocab.safetensors", d2t, t2d, "bench-tokenizer", coverage=1.0)
    return features


def hashing(features: Path, threads: list[int], repeats: int) -> dict[str, Any]:
    from eagle3_hf.features.store import load_manifest
    from eagle3_hf.features.verify import verify_shards

    shards = load_manifest(features)["shards"]
    paths = [features / s["file"] for s in shards]
    total = sum(s["bytes"] for s in shards)
    best: dict[str, float] = {}
    for _ in range(repeats):
        for cache in ("cold", "warm"):
            for t in threads:
                if cache == "cold":
                    drop_cache(paths)
                else:
                    verify_shards(features, shards, "always", threads=max(threads))  # read into the page cache
                start = time.perf_counter()
                assert verify_shards(features, shards, "always", threads=t) == len(shards)
                seconds = time.perf_counter() - start
                key = f"{cache}_{t}"
                best[key] = min(best.get(key, float("inf")), seconds)
    out: dict[str, Any] = {"shards": len(shards), "gb": round(total / 1e9, 3)}
    for key, seconds in best.items():
        cache, t = key.split("_")
        out[f"{key}_threads_gb_per_s"] = round(total / 1e9 / seconds, 3)
        if t != "1":
            out[f"{cache}_ratio_{t}_threads_over_1"] = round(best[f"{cache}_1"] / seconds, 3)
    return out


def launch(root: Path, features: Path, extra: list[str]) -> float:
    from eagle3_hf.scripts.train import main as train_main

    drop_cache([p for p in features.iterdir() if p.name.startswith("shard-")])
    out = root / "run"
    start = time.perf_counter()
    train_main(["--verifier", str(root / "verifier"), "--features", str(features), "--output-dir", str(out),
                "--max-steps", "1", "--save-strategy", "no", "--eval-strategy", "no", "--report-to", "none",
                "--max-seq-len", "1024", "--per-device-train-batch-size", "1", "--disable-tqdm", "true",
                "--use-cpu", "true", "--validation-fraction", "0", *extra])
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def first_launch(root: Path, features: Path, threads: int, repeats: int) -> dict[str, Any]:
    from eagle3_hf.features.verify import STAMP

    runs = {"once_as_written": ["--verify-features", "once"],
            "always_1_thread": ["--verify-features", "always", "--verify-threads", "1"],
            f"always_{threads}_threads": ["--verify-features", "always", "--verify-threads", str(threads)]}
    best: dict[str, float] = {}
    for _ in range(repeats):
        for name, extra in runs.items():
            (features / STAMP).unlink(missing_ok=True)
            best[name] = min(best.get(name, float("inf")), launch(root, features, extra))
    out: dict[str, Any] = {f"{k}_s": round(v, 2) for k, v in best.items()}
    base = best["once_as_written"]
    for name in list(runs)[1:]:
        out[f"{name}_hashing_s"] = round(best[name] - base, 2)
        out[f"ratio_{name}_over_once"] = round(best[name] / base, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=3.0)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--shard-mb", type=int, default=256)
    parser.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="thread counts to hash with")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write the features (default: a temporary directory)")
    parser.add_argument("--skip-launch", action="store_true", help="hashing rates only")
    args = parser.parse_args()
    threads = sorted({int(t) for t in args.threads.split(",")})
    root = Path(tempfile.mkdtemp(prefix="eagle3_first_launch_", dir=args.dir))
    try:
        start = time.perf_counter()
        features = write_features(root, args.gb, args.hidden, args.shard_mb)
        result: dict[str, Any] = {"write_s": round(time.perf_counter() - start, 1), "cpus": os.cpu_count(),
                                  "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                           text=True).stdout.strip()}
        result["hashing"] = hashing(features, threads, args.repeats)
        if not args.skip_launch:
            result["first_launch"] = first_launch(root, features, max(threads), args.repeats)
        print(json.dumps(result, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
