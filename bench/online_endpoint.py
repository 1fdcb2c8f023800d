"""Online training from vLLM's feature server against offline shards: tokens/s, wait fraction, peak disk.

One run: the tiny serveable verifier (hidden 128, 6 layers, SmolLM2's vocabulary; vLLM's CPU build), prepared
random walks, features extracted once with `extract --engine vllm` (bf16), then the same training steps
(the training script, in this process) offline from the shards and online from `eagle3-hf serve-features`,
alternating `--rounds` times; medians reported.

Isolation on 2 shared cores: the feature server is started with this process pinned to core 1 (vLLM and its
threads inherit it, 1 OMP thread), then this process (the trainer, 1 torch thread, and its 2 data-loader
workers) pins itself to core 0. Offline runs under the same pinning with the server idle. Other jobs share
the machine: the load average is printed beside the numbers.

Measured: training tokens/s (real tokens of the rows trained over train_runtime); the fraction of the
train loop spent waiting for the next batch (time inside the DataLoader iterator's __next__ in the main
process over train_runtime); the peak disk of each mode (offline: the feature directory plus extraction's
peak temporary bytes; online: the server's storage directory, polled every 5 ms).

    .venv/bin/python -m bench.online_endpoint [--samples 96] [--steps 24] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


class Waits:
    """Time the main process spends in DataLoader iterators' __next__ (waiting for a batch)."""

    def __init__(self) -> None:
        from torch.utils.data import dataloader

        self.seconds = 0.0
        self._cls = dataloader._BaseDataLoaderIter
        self._orig = self._cls.__next__
        waits = self

        def timed(it):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return waits._orig(it)
            finally:
                waits.seconds += time.perf_counter() - start

        self._cls.__next__ = timed  # type: ignore[method-assign]

    def close(self) -> None:
        self._cls.__next__ = self._orig  # type: ignore[method-assign]


def train_once(common: list[str], extra: list[str], out: Path) -> dict:
    from eagle3_hf.scripts.train import main as train_main

    waits = Waits()
    try:
        summary = train_main(common + extra + ["--output-dir", str(out)])
    finally:
        waits.close()
    history = summary["log_history"]
    end = next(h for h in history if "train_runtime" in h)
    runtime, steps = end["train_runtime"], end["step"]
    return {"runtime_s": runtime, "steps": steps, "wait_s": waits.seconds,
            "losses": [h["loss"] for h in summary["log_history"] if "loss" in h]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import AutoTokenizer

    from eagle3_hf.data.fingerprint import tokenizer_fingerprint
    from eagle3_hf.data.prepared_samples import PreparedDataset
    from eagle3_hf.data.vocab import save_vocab, vocab_from_target_ids
    from eagle3_hf.features.commands.serve_features import ServerSettings, start_feature_server
    from eagle3_hf.features.packing import PackedDataset
    from eagle3_hf.features.reader import FeatureDataset
    from eagle3_hf.features.vllm.vllm_spec import VllmOptions
    from eagle3_hf.verifier.loading import default_verifier_dir

    from tests.helpers.serveable import VOCAB, serveable_verifier, walk_prepared

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_online_"))
    tokenizer = AutoTokenizer.from_pretrained(default_verifier_dir())
    fingerprint = tokenizer_fingerprint(tokenizer)
    vdir = root / "verifier"
    serveable_verifier().save_pretrained(vdir)
    tokenizer.save_pretrained(vdir)
    prepared = walk_prepared(root / "prepared", fingerprint, n=args.samples)
    feats = root / "feats"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    done = subprocess.run([str(Path(sys.executable).parent / "eagle3-hf"), "extract", "--engine", "vllm",
                           "--verifier", str(vdir), "--data", str(prepared), "--output", str(feats),
                           "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    extract = json.loads(done.stdout.strip().splitlines()[-1])
    every = FeatureDataset(feats, split="all")
    greedy = torch.cat([every[i]["verifier_greedy"] for i in range(len(every))]).unique()
    d2t, t2d = vocab_from_target_ids(greedy, VOCAB)
    save_vocab(root / "vocab.safetensors", d2t, t2d, fingerprint, coverage=1.0)
    plan = PackedDataset(PreparedDataset(prepared, "train", 0.05, fingerprint), args.max_seq_len)
    tokens_per_row = plan.stats["tokens"] / plan.stats["rows"]
    common = ["--verifier", str(vdir), "--vocab", str(root / "vocab.safetensors"), "--max-steps", str(args.steps),
              "--logging-steps", "1", "--save-strategy", "no", "--eval-strategy", "no",
              "--max-seq-len", str(args.max_seq_len), "--per-device-train-batch-size", str(args.batch),
              "--disable-tqdm", "true", "--seed", "7", "--report-to", "none", "--dataloader-num-workers", "2"]

    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, trainer_cpu = ({cpus[-1]}, {cpus[0]}) if len(cpus) > 1 else (set(cpus), set(cpus))
    os.sched_setaffinity(0, server_cpu)  # the server (and every thread it starts) inherits this
    server = start_feature_server(ServerSettings(str(vdir), vllm=VllmOptions(max_model_len=args.max_seq_len + 1,
                                                                              threads=1, timeout=1800)))
    runs: dict[str, list[dict]] = {"offline": [], "online": []}
    with server:
        os.sched_setaffinity(0, trainer_cpu)
        peak = {"bytes": 0}
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                peak["bytes"] = max(peak["bytes"], dir_bytes(Path(server.storage)))
                time.sleep(0.005)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        for r in range(args.rounds):
            runs["offline"].append(train_once(common, ["--features", str(feats)], root / f"off{r}"))
            runs["online"].append(train_once(common, ["--features", server.url, "--prepared-dir",
                                                      str(prepared), "--features-dtype", "bf16"], root / f"on{r}"))
        stop.set()
        watcher.join()
        left = [p.name for p in Path(server.storage).rglob("*") if p.name != "pid"]
    result: dict = {"samples": args.samples, "steps": args.steps, "rounds": args.rounds, "batch_rows": args.batch,
                    "tokens_per_row": round(tokens_per_row, 1), "pinning": {"server": sorted(server_cpu),
                                                                           "trainer": sorted(trainer_cpu)},
                    "load_average": os.getloadavg()}
    for mode, rs in runs.items():
        tps = [r["steps"] * args.batch * tokens_per_row / r["runtime_s"] for r in rs]
        result[mode] = {"tokens_per_s": round(statistics.median(tps), 1),
                        "wait_fraction": round(statistics.median(r["wait_s"] / r["runtime_s"] for r in rs), 3),
                        "runtime_s": [round(r["runtime_s"], 2) for r in rs]}
    result["throughput_ratio_online_over_offline"] = round(result["online"]["tokens_per_s"]
                                                           / result["offline"]["tokens_per_s"], 3)
    result["losses_equal"] = all(a["losses"] == b["losses"] for a, b in zip(runs["offline"], runs["online"]))
    result["peak_disk_bytes"] = {"offline_features": dir_bytes(feats),
                                 "offline_extract_temporary": extract.get("peak_temporary_bytes"),
                                 "online_server_storage": peak["bytes"], "online_left_after": left}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
