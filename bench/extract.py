"""Extraction benchmark on the real default verifier (SmolLM2-135M), all ratios measured in one run.

- throughput: tokens/s of `extract_features` (hooks + greedy + quantise + write shards) over tokens/s of the
  bare verifier forward `model(input_ids)` on the same samples (goal >= 0.9);
- bytes per token on disk for bf16 and fp8, against the 4 x hidden x 2 of bf16 aux + last states;
- peak memory during extraction: RSS above the loaded model (sampled), Python heap (tracemalloc), and what
  `output_hidden_states=True` would have held for the longest sample.

    python -m bench.extract [--samples 24] [--max-len 128] [--threads 1]

Sized for a 2-core CPU (about 2 minutes there): five passes over the samples in all.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import psutil
import torch


def _samples(tokenizer, n: int, max_len: int) -> list[list[int]]:
    from eagle3_hf.demo_data.prompts import training_conversations

    out = []
    for conv in training_conversations(limit=4 * n):
        ids = tokenizer.apply_chat_template(conv["messages"], tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if len(ids) >= 32:
            out.append(list(ids)[:max_len])
        if len(out) == n:
            break
    return out


class PeakRSS:
    """Samples this process's RSS every 5 ms in a thread; `.peak` after the block."""

    def __enter__(self):
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self.base = self.proc.memory_info().rss
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="alternating timed rounds; the best of each is kept")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a busy shared box, 1 avoids threads waiting on each other)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import datasets

    from eagle3_hf.data.fingerprint import tokenizer_fingerprint
    from eagle3_hf.features.routes.transformers import extract_features
    from eagle3_hf.features.write import StoreOptions
    from eagle3_hf.verifier.family import default_aux_indices
    from eagle3_hf.verifier.loading import load_tokenizer, load_verifier

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    model = load_verifier("smollm2-135m-instruct", dtype=dtype).to(device)
    tok = load_tokenizer("smollm2-135m-instruct")
    fp = tokenizer_fingerprint(tok)
    ids = _samples(tok, args.samples, args.max_len)
    tokens = sum(map(len, ids))
    ds = datasets.Dataset.from_dict({"id": [f"b{i}" for i in range(len(ids))], "input_ids": ids,
                                     "loss_mask": [[1] * len(x) for x in ids]})
    H, N = model.config.hidden_size, model.config.num_hidden_layers
    work = Path(tempfile.mkdtemp(prefix="eagle3_bench_extract_"))

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def bare(samples=ids) -> float:
        t = time.perf_counter()
        for x in samples:
            model(torch.tensor([x], device=device)).logits.argmax(-1)
        sync()
        return time.perf_counter() - t

    def extract(out: Path, feat_dtype: str) -> float:
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        extract_features(model, fp, ds, out, dtype=feat_dtype, store=StoreOptions(16), progress=False)
        sync()
        return time.perf_counter() - t

    bare(ids[:3])  # warm-up (allocator, kernels)
    t_bare, t_ext = [], []
    for _ in range(args.repeats):  # alternate, so drifting machine load hits both alike
        t_bare.append(bare())
        t_ext.append(extract(work / "bf16", "bf16"))

    def bytes_per_token(d: Path) -> float:
        return sum(p.stat().st_size for p in d.glob("shard-*.safetensors")) / tokens

    tracemalloc.start()  # memory on the fp8 pass (the same capture path, plus quantisation)
    with PeakRSS() as rss:
        extract(work / "fp8", "fp8")
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    longest = max(map(len, ids))
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    result = {
        "device": device, "verifier_dtype": dtype, "torch_threads": torch.get_num_threads(), "samples": len(ids),
        "tokens": tokens,
        "layers": N, "hidden": H, "aux_indices": list(default_aux_indices(N)),
        "bare_forward_tok_s": round(tokens / min(t_bare), 1),
        "extract_tok_s": round(tokens / min(t_ext), 1),
        "throughput_ratio": round(min(t_bare) / min(t_ext), 3),
        "bytes_per_token_reference_4xHx2": 4 * H * 2,
        "bytes_per_token_bf16": round(bytes_per_token(work / "bf16"), 1),
        "bytes_per_token_fp8": round(bytes_per_token(work / "fp8"), 1),
        "fp8_over_bf16": round(bytes_per_token(work / "fp8") / bytes_per_token(work / "bf16"), 3),
        "extract_peak_rss_above_start_mb": round((rss.peak - rss.base) / 2**20, 1),
        "extract_python_heap_peak_mb": round(py_peak / 2**20, 2),
        "captured_states_longest_sample_mb": round(4 * longest * H * elem / 2**20, 2),
        "output_hidden_states_longest_sample_mb": round((N + 1) * longest * H * elem / 2**20, 2),
    }
    if device == "cuda":
        result["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
