"""Dataset read benchmark: FeatureDataset against reading the same bytes raw, ratios from one run.

Writes synthetic bf16 shards (hidden 576, like the default verifier), warms the page cache, then times
- raw: for every sample, `readinto` a preallocated buffer of each of its tensor byte ranges (no decoding);
- stored: `FeatureDataset.raw(i)` views into the memory-mapped shard, copied into a preallocated buffer of
  the stored dtype (the same bytes, the same destination as raw);
- items: `FeatureDataset[i]`, features decoded to fresh float32 tensors (2x the bytes written);
- batches: PackedDataset + PackedCollator, rows of 2048 tokens decoded straight into the [B, L, .] batch.
Goal: >= 0.8 of raw in tokens per second.
- loader: the Trainer's DataLoader (one 2,048-token row per batch, as the recipes train) at each `--workers` count,
  tokens/s and feature bytes/s, beside what `eagle3-hf plan` says one node needs for `--recipe` (with
  `--shape llama31-8b`: hidden 4096, 4 states, the Llama-3.1-8B DDP recipe on 8 GPUs).

    python -m bench.dataset_read [--samples 64] [--tokens 512] [--hidden 576]
    python -m bench.dataset_read --shape llama31-8b --workers 0,1,2
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="mean tokens per sample")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=["llama31-8b"], default=None,
                        help="hidden 4096 and the Llama-3.1-8B DDP recipe for the node's need")
    parser.add_argument("--workers", default="0", help="DataLoader worker counts to time, e.g. 0,1,2")
    parser.add_argument("--recipe", default=None, help="recipe whose plan gives the node's need (feature read rate)")
    parser.add_argument("--verifier-config", default=None)
    parser.add_argument("--accelerate-config", default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 = like a DataLoader worker (and on a busy 2-core box, 2 threads "
                             "make every copy wait for both cores)")
    args = parser.parse_args()
    if args.shape == "llama31-8b":
        args.hidden = 4096
        args.recipe = args.recipe or "examples/recipes/llama31_8b_8gpu_ddp.yaml"
        args.verifier_config = args.verifier_config or "examples/recipes/llama31_8b_text_config.json"
        args.accelerate_config = args.accelerate_config or "accelerate_configs/8gpu_ddp.yaml"
    torch.set_num_threads(args.threads)

    from eagle3_hf.features.packing import PackedCollator, PackedDataset
    from eagle3_hf.features.reader import FeatureDataset
    from eagle3_hf.features.records import make_header
    from eagle3_hf.features.shard_writer import ShardWriter
    from eagle3_hf.features.store import merge_manifests

    work = Path(tempfile.mkdtemp(prefix="eagle3_bench_read_"))
    H, g = args.hidden, torch.Generator().manual_seed(0)
    header = make_header({"name": "bench", "revision": None, "num_hidden_layers": 30, "hidden_size": H,
                          "vocab_size": 49152}, "bench", (2, 15, 27), args.dtype)
    writer = ShardWriter(work, header, samples_per_shard=16)
    tokens = 0
    for i in range(args.samples):
        t = int(torch.randint(args.tokens // 2, args.tokens * 3 // 2, (1,), generator=g))
        tokens += t
        writer.add(f"r{i}", torch.randint(0, 49152, (t,), generator=g), torch.ones(t, dtype=torch.bool),
                   torch.randn(t, 3 * H, generator=g), torch.randn(t, H, generator=g),
                   torch.randint(0, 49152, (t,), generator=g))
    writer.close()
    merge_manifests(work)
    ds = FeatureDataset(work, split="all", verify="none")
    shard_bytes = sum(p.stat().st_size for p in work.glob("shard-*"))

    # the byte ranges of every sample's tensors, for the raw reader
    ranges = [r for i in range(len(ds)) for r in ds.byte_ranges(i)]
    sample_bytes = sum(n for _, _, n in ranges)
    buf = bytearray(max(n for _, _, n in ranges))

    def raw_read() -> float:
        t = time.perf_counter()
        handles = {}
        for name, start, n in ranges:
            f = handles.get(name) or handles.setdefault(name, open(name, "rb"))
            f.seek(start)
            f.readinto(memoryview(buf)[:n])
        for f in handles.values():
            f.close()
        return time.perf_counter() - t

    dest = torch.frombuffer(buf, dtype=torch.uint8)

    def stored() -> float:
        t = time.perf_counter()
        for i in range(len(ds)):
            for v in ds.raw(i).values():
                b = v.reshape(-1).view(torch.uint8)
                dest[: b.numel()].copy_(b)  # a view alone reads nothing: copy its bytes out, as raw does
        return time.perf_counter() - t

    def items() -> float:
        t = time.perf_counter()
        for i in range(len(ds)):
            ds[i]
        return time.perf_counter() - t

    packed = PackedDataset(ds, 2048, seed=0)
    collate = PackedCollator()

    def batches() -> float:
        t = time.perf_counter()
        for r in range(0, len(packed), 2):
            collate([packed[j] for j in range(r, min(r + 2, len(packed)))])
        return time.perf_counter() - t

    for fn in (raw_read, stored, items, batches):  # warm page cache and code paths
        fn()
    times: dict[str, list[float]] = {"raw": [], "stored": [], "items": [], "batches": []}
    for _ in range(args.repeats):  # alternate so machine noise hits all alike
        for name, fn in (("raw", raw_read), ("stored", stored), ("items", items), ("batches", batches)):
            times[name].append(fn())
    best = {k: min(v) for k, v in times.items()}
    loader = {w: loader_rate(packed, tokens, int(w), args.repeats) for w in args.workers.split(",")}
    result = {
        "samples": len(ds), "tokens": tokens, "hidden": H, "dtype": args.dtype,
        "shard_mb": round(shard_bytes / 2**20, 1), "sample_bytes_mb": round(sample_bytes / 2**20, 1),
        "raw_mb_s": round(sample_bytes / best["raw"] / 2**20, 1),
        "tok_s": {k: round(tokens / v, 1) for k, v in best.items()},
        "ratio_items_over_raw": round(best["raw"] / best["items"], 3),
        "ratio_stored_over_raw": round(best["raw"] / best["stored"], 3),
        "ratio_batches_over_raw": round(best["raw"] / best["batches"], 3),
        "loader": {f"workers_{w}": {"tok_s": round(r, 1), "feature_gb_s": round(r * (4 * H * 2) / 1e9, 3)}
                   for w, r in loader.items()},
    }
    if args.recipe:
        result["node_needs"] = node_need(args.recipe, args.verifier_config, args.accelerate_config)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))


def loader_rate(packed, tokens: int, workers: int, repeats: int) -> float:
    """Tokens/s of the DataLoader the Trainer builds: one packed row per batch, `workers` processes."""
    from torch.utils.data import DataLoader

    from eagle3_hf.features.packing import PackedCollator

    loader = DataLoader(packed, batch_size=1, collate_fn=PackedCollator(), num_workers=workers,
                        persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    for _ in loader:  # start the workers, warm the page cache
        pass
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in loader:
            pass
        best = min(best, time.perf_counter() - t)
    return tokens / best


def node_need(recipe_path: str, verifier_config: str | None, accelerate_config: str | None) -> dict:
    """The feature read rate one node needs by the plan (its MFU assumption), for the recipe's dataset-free plan."""
    import yaml

    from eagle3_hf.train.plan import build_plan
    from eagle3_hf.train.plan_inputs import read_launch, verifier_text_config

    recipe = yaml.safe_load(Path(recipe_path).read_text())
    launch = read_launch(accelerate_config, recipe)
    plan = build_plan(recipe, launch, verifier_text_config(recipe, verifier_config), 1e6,
                      mean_document=float(recipe.get("max_seq_len", 2048)))
    data = plan.data
    assert data is not None  # a dataset size was given
    return {"recipe": recipe_path, "gpus": launch.num_processes, "mfu": data.mfu,
            "tok_s": round(data.read_tokens_per_s_per_node, 1),
            "feature_gb_s": round(data.read_bytes_per_s_per_node / 1e9, 3)}


if __name__ == "__main__":
    main()
