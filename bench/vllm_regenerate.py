"""`regenerate --engine vllm --features-out` against the in-process `regenerate --features-out` and against vLLM's
plain generation, on the same prompts, in one run (the embedded SmolLM2 verifier, fp32, one thread each).

- features per CPU-second: sample tokens (prompt + answer + template tail) written to the feature shards per
  CPU-second of the whole command (the CLI and, for vLLM, its runner process), model loads included;
- new tokens per CPU-second of vLLM's plain generation (no speculative method, no connector, vLLM's own
  caching; the same runner and rounds, generate_plain) against the generated tokens of
  `regenerate --engine vllm` per CPU-second (what extraction, prepare and the second prefill cost on top).

    .venv/bin/python -m bench.vllm_regenerate [--prompts 64] [--max-new-tokens 128] [--threads 1]

CPU seconds come from RUSAGE_CHILDREN (scripts/vllm_regenerate_throughput.py's helpers): a finished child's
CPU, its own waited-for children (the vLLM runner) included; steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from scripts.vllm_regenerate_throughput import children_cpu
from scripts.vllm_regenerate_throughput import regenerate as run_cli

VERIFIER = "smollm2-135m-instruct"


def feature_tokens(features: Path) -> int:
    """Sample tokens in a finished feature directory (its manifest)."""
    from eagle3_hf.features.store import load_manifest

    return sum(int(s["length"]) for s in load_manifest(features)["samples"])


def generated_tokens(answers: Path, tokenizer) -> int:
    """Tokens of the regenerated answers, counted with the verifier's tokenizer (as the throughput script)."""
    from scripts.vllm_regenerate_throughput import new_tokens

    return new_tokens(answers, tokenizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64, help="in-process regenerate's batch")
    args = parser.parse_args(argv)
    os.environ.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads))

    from eagle3_hf.data.conversations import write_jsonl
    from eagle3_hf.demo_data.prompts import short_prompts
    from eagle3_hf.features.vllm.vllm_generation import generate_plain, prompt_ids
    from eagle3_hf.verifier.loading import load_tokenizer

    prompts = short_prompts(args.prompts)
    tokenizer = load_tokenizer(VERIFIER)
    common = ["--verifier", VERIFIER, "--max-new-tokens", str(args.max_new_tokens), "--torch-dtype", "float32"]
    result: dict = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_jsonl(work / "p.jsonl", prompts)
        runs = {"vllm": ["--engine", "vllm", "--threads", str(args.threads), "--no-progress"],
                "in_process": ["--batch-size", str(args.batch_size)]}
        for name, extra in runs.items():
            wall, cpu = run_cli(["--input", str(work / "p.jsonl"), "--output", str(work / f"{name}.jsonl"),
                                 "--features-out", str(work / f"f_{name}"), "--prepared-out", str(work / f"p_{name}"),
                                 *common, *extra])
            tokens = feature_tokens(work / f"f_{name}")
            new = generated_tokens(work / f"{name}.jsonl", tokenizer)
            result[name] = {"feature_tokens": tokens, "new_tokens": new, "cpu_seconds": round(cpu, 2),
                            "wall_seconds": round(wall, 2), "features_per_cpu_s": round(tokens / cpu, 1),
                            "new_tokens_per_cpu_s": round(new / cpu, 1)}
        ids = [prompt_ids(tokenizer, p["messages"], p.get("tools")) for p in prompts]
        before, clock, start = children_cpu(), time.process_time(), time.perf_counter()
        outputs, runner = generate_plain(VERIFIER, ids, max_new_tokens=args.max_new_tokens, vllm_dtype="float32",
                                         max_model_len=max(map(len, ids)) + args.max_new_tokens + 1,
                                         threads=args.threads)
        cpu = children_cpu() - before + time.process_time() - clock
        new = sum(len(o) for o, _ in outputs)
        result["vllm_plain_generation"] = {"new_tokens": new, "cpu_seconds": round(cpu, 2),
                                           "wall_seconds": round(time.perf_counter() - start, 2),
                                           "load_seconds": round(runner.get("load_seconds", 0.0), 2),
                                           "new_tokens_per_cpu_s": round(new / cpu, 1)}
    v, t, p = result["vllm"], result["in_process"], result["vllm_plain_generation"]
    result["ratio_features_vllm_over_in_process"] = round(v["features_per_cpu_s"] / t["features_per_cpu_s"], 3)
    result["ratio_new_tokens_vllm_regenerate_over_plain_generation"] = round(
        v["new_tokens_per_cpu_s"] / p["new_tokens_per_cpu_s"], 3)
    result["peak_rss_mib_children"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
