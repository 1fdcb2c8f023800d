"""gpu_check's rates on the GPU machine: the verifier's greedy head at Kimi-K2.5's shape on the device (tokens/s,
agreement with fp32), the training loader's rows/s beside what `eagle3-hf plan` says a GPU needs, and the shard
hashing rate (1 and N threads). The loader and hashing read files just written: the page cache's rate, what this
machine's CPUs allow, not its disks'."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .train_step import sync

REPO = Path(__file__).resolve().parent.parent
KIMI_RECIPE = REPO / "examples/recipes/kimi_k25_8gpu_ddp.yaml"
KIMI_TEXT_CONFIG = REPO / "examples/recipes/kimi_k25_text_config.json"
DDP_CONFIG = REPO / "accelerate_configs/8gpu_ddp.yaml"


def timed(fn, device: str, repeats: int = 3) -> float:
    """Median seconds of `fn()` after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def greedy_head(device: str, tiny: bool) -> dict:
    """verifier/greedy.py's head, bf16 weights with the top candidates rescored in fp32 (what extraction runs),
    against the fp32 head, and both against a plain fp32 matmul + argmax: tokens/s and agreement."""
    from eagle3_hf.verifier.greedy import greedy_argmax

    hidden, vocab, tokens = (128, 2048, 256) if tiny else (7168, 163840, 4096)
    g = torch.Generator().manual_seed(0)
    w16 = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, torch.bfloat16)  # checkpoints store bf16
    w32 = w16.float()
    h = (torch.randn(tokens, hidden, generator=g) * 2).to(device)
    chunk = max(1, (1 << 26) // vocab)
    with torch.no_grad():
        reference = torch.cat([(h[s:s + chunk] @ w32.T).argmax(-1) for s in range(0, tokens, chunk)])
        out16, out32 = greedy_argmax(w16, h), greedy_argmax(w32, h)
    s16 = timed(lambda: greedy_argmax(w16, h), device)
    s32 = timed(lambda: greedy_argmax(w32, h), device)
    agree16 = float((out16 == reference).float().mean())
    return {"hidden": hidden, "vocab": vocab, "tokens": tokens, "bf16_tokens_per_s": tokens / s16,
            "fp32_tokens_per_s": tokens / s32, "bf16_agreement_with_fp32": agree16,
            "fp32_agreement_with_fp32": float((out32 == reference).float().mean()), "ok": agree16 >= 0.999}


def loader_rows(tiny: bool, workers: tuple[int, ...] = (0, 4)) -> dict:
    """The Trainer's DataLoader over bf16 shards at Kimi-K2.5's hidden size (one 2,048-token row per batch, as the
    recipes train), against the rate `eagle3-hf plan` says one GPU must be fed at for kimi_k25_8gpu_ddp.yaml."""
    from eagle3_hf.features.packing import PackedDataset
    from eagle3_hf.features.reader import FeatureDataset
    from eagle3_hf.features.records import make_header
    from eagle3_hf.features.shard_writer import ShardWriter
    from eagle3_hf.features.store import merge_manifests

    from bench.dataset_read import loader_rate, node_need

    hidden, row, rows = (128, 256, 4) if tiny else (7168, 2048, 4)
    workers = workers[:1] if tiny else workers
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="gpu_check_loader_") as tmp:
        header = make_header({"name": "gpu_check", "revision": None, "num_hidden_layers": 61, "hidden_size": hidden,
                              "vocab_size": 163840}, "gpu_check", (2, 30, 58), "bfloat16")
        writer = ShardWriter(tmp, header, samples_per_shard=2)
        for i in range(rows * 2):  # two documents per row
            n = row // 2
            writer.add(f"r{i}", torch.randint(0, 163840, (n,), generator=g), torch.ones(n, dtype=torch.bool),
                       torch.randn(n, 3 * hidden, generator=g), torch.randn(n, hidden, generator=g),
                       torch.randint(0, 163840, (n,), generator=g))
        writer.close()
        merge_manifests(tmp)
        packed = PackedDataset(FeatureDataset(tmp, split="all", verify="none"), row, seed=0)
        rates = {w: loader_rate(packed, rows * row, w, repeats=2) for w in workers}
    need = node_need(str(KIMI_RECIPE), str(KIMI_TEXT_CONFIG), str(DDP_CONFIG))
    need["recipe"] = str(KIMI_RECIPE.relative_to(REPO))
    per_gpu = need["tok_s"] / max(1, need["gpus"])
    best = max(rates.values())
    return {"hidden": hidden, "row_tokens": row,
            "rows_per_s": {f"workers_{w}": r / row for w, r in rates.items()},
            "plan_rows_per_s_per_gpu": per_gpu / 2048, "plan": need,
            "best_over_plan": best / per_gpu if not tiny else None}


def hashing(tiny: bool) -> dict:
    """sha256 of shard-sized files as verify.py hashes them (store.sha256_file), one thread and N threads."""
    from eagle3_hf.features.store import sha256_file

    files, mib = (4, 4) if tiny else (8, 128)
    threads = min(files, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="gpu_check_hash_") as tmp:
        paths = []
        for i in range(files):
            path = Path(tmp) / f"shard-{i}.bin"
            path.write_bytes(os.urandom(mib << 20))
            paths.append(path)
        total = files * (mib << 20)
        t0 = time.perf_counter()
        one = [sha256_file(p) for p in paths]
        single = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            many = list(pool.map(sha256_file, paths))
        parallel = time.perf_counter() - t0
    return {"files": files, "mib_each": mib, "threads": threads, "gb_per_s_1_thread": total / single / 1e9,
            f"gb_per_s_{threads}_threads": total / parallel / 1e9, "same_digests": one == many}
