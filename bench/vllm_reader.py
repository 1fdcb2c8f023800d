"""`extract --engine vllm`'s reader at Llama-3.1-8B's and Kimi-K2.5's shapes: connector files -> committed shards.

Synthetic files as vLLM's hidden-states connector writes them (`hidden_states` [T, 4, H] bf16, `token_ids` [T])
are turned into shards (bf16, checksummed, fsynced: the ShardWriter every route uses) by three paths, timed
alternately in one run, median of `--rounds`:

- `before`: the reader as it was (one thread: the whole file copied to float32, a finiteness pass, the aux states
  concatenated in float32; the writer then checked finiteness again, rounded to bf16 and hashed each sample);
- `readers_1`, `readers_N`: `VllmFeatureSpec.features` with 1 and N reader threads (work in the file's dtype,
  one aminmax pass, the sample hashed by its reader) and as many shard writers, as `extract --engine vllm` runs.

Also timed: `reader_only_1` (one reader, files -> samples ready for a shard, no writer: the per-reader rate
`eagle3-hf plan --reader-gbps` takes) and `writer_only_1`, `writer_only_N` (the shard writer alone on ready samples
with 1 and N commit threads: each concatenates, serialises, hashes, writes and fsyncs a shard; --samples-per-shard
1 by default so that N shards can be in flight). On a node the verifier's final norm
and greedy head run on the GPU (bench/greedy_head.py times the head); here the norm runs on the CPU (so the rates
are a lower bound for a node's reader) and a 16-row fp32 head stands in for the vocabulary. Printed beside each
shape: the prefill rate `eagle3-hf plan` says the node's engines produce (2 x active FLOPs at --mfu on 8 GPUs)
and the readers it says they need at the measured per-reader rate.

    python -m bench.vllm_reader [--tokens 2048] [--files 4] [--readers N] [--rounds 3] [--shapes llama31_8b,kimi_k25]

Data: --files files per shape, linked afresh for each run (the readers delete what they read): 4 x 64 MB at
Llama's shape, 4 x 117 MB at Kimi's, plus the shards of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3_hf.features.engine_states import check_states
from eagle3_hf.features.interface import PreparedSample
from eagle3_hf.features.shard_writer import ShardWriter
from eagle3_hf.features.vllm.vllm_spec import VllmFeatureSpec, default_readers
from eagle3_hf.train.plan import verifier_params
from eagle3_hf.train.plan_reader import node_prefill_tokens_per_s, reader_plan
from eagle3_hf.verifier.capture import greedy_tokens

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"llama31_8b": ROOT / "examples/recipes/llama31_8b_text_config.json",
          "kimi_k25": ROOT / "examples/recipes/kimi_k25_text_config.json"}
HEAD_ROWS = 16
GPUS_PER_ENGINE = {"llama31_8b": 1, "kimi_k25": 8}  # the guide's commands: 8 replicas; one engine over 8 GPUs


def head_checkpoint(out: Path, text_cfg: dict[str, Any]) -> Path:
    """A verifier directory holding only what the reader loads: config.json, the final norm and a small head."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in text_cfg.items() if not k.startswith("_")}
    cfg["vocab_size"] = HEAD_ROWS
    (out / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    g = torch.Generator().manual_seed(0)
    h = int(cfg["hidden_size"])
    save_file({"model.norm.weight": (1 + 0.1 * torch.randn(h, generator=g)).bfloat16(),
               "lm_head.weight": 0.02 * torch.randn(HEAD_ROWS, h, generator=g)},  # fp32: stays fp32, the fast CPU GEMM
              str(out / "model.safetensors"))
    return out


def connector_files(out: Path, n: int, tokens: int, layers: int, hidden: int) -> list[PreparedSample]:
    """n files as the connector writes them, and the samples they belong to."""
    out.mkdir(parents=True, exist_ok=True)
    samples = []
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, 100_000, (tokens,), generator=g)
        states = (torch.randn(tokens, layers, hidden, generator=g) * 4).bfloat16()  # [T, 4, H]
        save_file({"hidden_states": states, "token_ids": ids}, str(out / f"s{k}.safetensors"))
        samples.append(PreparedSample(f"s{k}", ids, torch.ones(tokens, dtype=torch.uint8)))
    return samples


def link_records(master: Path, storage: Path, samples: list[PreparedSample]) -> list[dict[str, Any]]:
    """Fresh names for a run (the readers delete them); the pages stay cached, as vLLM's just-written files are."""
    storage.mkdir(parents=True, exist_ok=True)
    records = []
    for k, s in enumerate(samples):
        path = storage / f"{s.sample_id}.safetensors"
        os.link(master / f"{s.sample_id}.safetensors", path)
        records.append({"key": k, "path": str(path)})
    return records


@torch.no_grad()
def before(spec: VllmFeatureSpec, record: dict[str, Any], sample: PreparedSample) -> tuple[Any, ...]:
    """The reader as it was: the whole file as float32, finiteness per layer, aux concatenated in float32."""
    states = check_states(load_file(record["path"]), record["path"], sample.sample_id, sample.input_ids,
                          spec.layer_ids, spec.hidden).float()
    assert bool(torch.isfinite(states).all(dim=(0, 2)).all())
    slot = {lid: j for j, lid in enumerate(spec.layer_ids)}
    aux = torch.cat([states[:, slot[int(i)]] for i in spec.indices], dim=-1)
    last = spec.norm(states[:, slot[spec.layer_ids[-1]]].to(next(spec.norm.parameters()).device))
    greedy = greedy_tokens(spec.head, last, spec.softcap)
    os.unlink(record["path"])
    return sample.input_ids, sample.loss_mask, aux, last, greedy


def run_before(spec: VllmFeatureSpec, records: list[dict[str, Any]], samples: list[PreparedSample],
               writer: ShardWriter) -> None:
    for record in records:
        ids, mask, aux, last, greedy = before(spec, record, samples[record["key"]])
        writer.add(samples[record["key"]].sample_id, ids, mask, aux, last, greedy)  # its finiteness, rounding


def run_readers(readers: int) -> Callable[..., None]:
    def run(spec: VllmFeatureSpec, records: list[dict[str, Any]], samples: list[PreparedSample],
            writer: ShardWriter | None) -> None:
        for feats in spec.features(iter(records), samples, readers=readers):
            if writer is not None:
                assert feats.stored is not None
                writer.add_stored(feats.sample.sample_id, feats.stored, feats.stored_sha256)
    return run


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def through_writer(run: Callable[..., None], spec: VllmFeatureSpec, records: list[dict[str, Any]],
                   samples: list[PreparedSample], out: Path, per_shard: int, writers: int) -> None:
    """One path from the files to committed shards (the writer closed: every shard hashed, written, fsynced)."""
    writer = ShardWriter(out, spec.header, samples_per_shard=per_shard, writers=writers)
    run(spec, records, samples, writer)
    writer.close()


def write_ready(spec: VllmFeatureSpec, ready: list[Any], out: Path, per_shard: int, writers: int) -> None:
    """The shard writer alone, on samples the readers made ready."""
    writer = ShardWriter(out, spec.header, samples_per_shard=per_shard, writers=writers)
    for feats in ready:
        writer.add_stored(feats.sample.sample_id, feats.stored, feats.stored_sha256)
    writer.close()


def measure_shape(name: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    text_cfg = json.loads(SHAPES[name].read_text(encoding="utf-8"))
    spec = VllmFeatureSpec(str(head_checkpoint(work / "verifier", text_cfg)), "bench", dtype="bf16",
                           vllm_dtype="bfloat16")
    samples = connector_files(work / "master", args.files, args.tokens, len(spec.layer_ids), spec.hidden)
    tokens = args.files * args.tokens
    n = args.readers
    paths: dict[str, tuple[Callable[..., None], int]] = {"before": (run_before, 1), "readers_1": (run_readers(1), 1),
                                                        f"readers_{n}": (run_readers(n), n)}
    seconds: dict[str, list[float]] = {k: [] for k in [*paths, "reader_only_1", "writer_only_1", f"writer_only_{n}"]}
    for r in range(args.rounds):
        for key, (run, writers) in paths.items():
            records = link_records(work / "master", work / f"storage_{key}_{r}", samples)
            took, _ = timed(through_writer, run, spec, records, samples, work / f"out_{key}_{r}",
                            args.samples_per_shard, writers)
            seconds[key].append(took)
            shutil.rmtree(work / f"out_{key}_{r}")
        records = link_records(work / "master", work / f"storage_only_{r}", samples)
        took, ready = timed(lambda rec: list(spec.features(iter(rec), samples)), records)
        seconds["reader_only_1"].append(took)
        for writers in (1, n):
            out = work / f"out_writer_{writers}_{r}"
            seconds[f"writer_only_{writers}"].append(timed(write_ready, spec, ready, out, args.samples_per_shard,
                                                           writers)[0])
            shutil.rmtree(out)
    rate = {k: round(tokens / statistics.median(v)) for k, v in seconds.items()}
    file_bytes = 2 * len(spec.layer_ids) * spec.hidden  # per token: [4, H] bf16
    active = verifier_params(text_cfg)["active"]
    node = node_prefill_tokens_per_s(active, 8, args.mfu, args.peak_tflops)
    plan = reader_plan(spec.hidden, node, 8, GPUS_PER_ENGINE[name], rate["reader_only_1"] * file_bytes / 1e9)
    return {
        "hidden": spec.hidden, "tokens_per_file": args.tokens, "files": args.files,
        "file_bytes_per_token": file_bytes, "active_params": active, "plan_node_tokens_per_s": round(node),
        "tokens_per_s": rate,
        "ratio_over_before": {k: round(v / rate["before"], 2) for k, v in rate.items() if k != "before"},
        "reader_gbps_1": round(rate["reader_only_1"] * file_bytes / 1e9, 3),
        "plan": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(plan).items()},
        "seconds": {k: [round(x, 3) for x in v] for k, v in seconds.items()},
    }


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?") if Path("/proc/cpuinfo").is_file() else "?"
    return {"cpu": cpu, "cpus": os.cpu_count(), "load_avg": [round(x, 1) for x in os.getloadavg()],
            "torch_threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens per file (a sample)")
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--readers", type=int, default=max(2, default_readers()))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples-per-shard", type=int, default=1)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--mfu", type=float, default=0.35, help="as `eagle3-hf plan --mfu`")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="as `eagle3-hf plan --peak-tflops` (H100/H200)")
    p.add_argument("--dir", default=None, help="where the files and shards go (default: a temporary directory)")
    args = p.parse_args(argv)
    results: dict[str, Any] = {"machine": machine(), "readers": args.readers}
    with tempfile.TemporaryDirectory(prefix="eagle3_bench_reader_", dir=args.dir) as tmp:
        for name in args.shapes.split(","):
            results[name] = measure_shape(name, Path(tmp) / name, args)
            shutil.rmtree(Path(tmp) / name)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
