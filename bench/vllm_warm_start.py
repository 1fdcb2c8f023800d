"""What the warm vLLM process (engines/vllm/warm_launch.py, EAGLE3_HF_VLLM_WARM) saves per engine start: one
`run_vllm` request (a tiny verifier, plain decoding of one prompt) started as a fresh process and forked from the
warm process, alternately in one run, --rounds each. CPU seconds are the runner's own (a fresh process's reaped
rusage, the warm children's from the warm process's count), wall seconds the caller's; the warm process's own
import is printed beside them (paid once per test session).

    python -m bench.vllm_warm_start [--rounds 3]     # needs `make vllm`
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from eagle3_hf.engines.vllm.vllm_env import run_vllm, vllm_environment, vllm_python, vllm_venv
from eagle3_hf.engines.vllm.vllm_request import GenerationRequest
from eagle3_hf.engines.vllm.warm_launch import WARM_ENV, start_warm

from tests.helpers.serveable import serveable_verifier


def children_cpu(warm_socket: str | None) -> float:
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = Path(f"{warm_socket}.cpu") if warm_socket else None
    return own.ru_utime + own.ru_stime + (float(warm.read_text()) if warm and warm.is_file() else 0.0)


def timed(request: GenerationRequest, warm_socket: str | None) -> tuple[float, float]:
    if warm_socket:
        os.environ[WARM_ENV] = warm_socket
    else:
        os.environ.pop(WARM_ENV, None)
    cpu0, wall0 = children_cpu(warm_socket), time.perf_counter()
    run_vllm(request)
    return children_cpu(warm_socket) - cpu0, time.perf_counter() - wall0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from eagle3_hf.verifier.loading import default_verifier_dir, load_tokenizer

    folder = tempfile.mkdtemp(prefix="eagle3_warm_bench_")
    verifier = Path(folder) / "verifier"
    serveable_verifier().save_pretrained(verifier)
    load_tokenizer(default_verifier_dir()).save_pretrained(verifier)
    request = GenerationRequest(verifier=str(verifier), prompts=[[1, 2, 3, 4, 5]], max_new_tokens=8, max_model_len=256)
    sock = os.path.join(folder, "vllm.sock")
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with open(os.path.join(folder, "warm.log"), "w", encoding="utf-8") as log:
        warm = start_warm(vllm_python(), vllm_environment(vllm_venv(), 1, offline=True), sock, log)
    while not os.path.exists(sock):
        if warm.poll() is not None:
            raise SystemExit(f"the warm process exited: {Path(folder, 'warm.log').read_text()[-2000:]}")
        time.sleep(0.1)
    ready_wall = time.perf_counter() - wall0
    runs: dict[str, list[tuple[float, float]]] = {"fresh": [], "warm": []}
    for _ in range(args.rounds):
        runs["fresh"].append(timed(request, None))
        runs["warm"].append(timed(request, sock))
    warm.terminate()
    warm.wait()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    warm_total = cpu1.ru_utime + cpu1.ru_stime - (cpu0.ru_utime + cpu0.ru_stime)
    fresh_cpu = sum(c for c, _ in runs["fresh"])
    children = sum(c for c, _ in runs["warm"])
    out = {name: {"cpu_s": round(statistics.median(c for c, _ in rows), 2),
                  "wall_s": round(statistics.median(w for _, w in rows), 2)} for name, rows in runs.items()}
    out["ratio_cpu_warm_over_fresh"] = round(out["warm"]["cpu_s"] / out["fresh"]["cpu_s"], 3)
    out["ratio_wall_warm_over_fresh"] = round(out["warm"]["wall_s"] / out["fresh"]["wall_s"], 3)
    # the warm process's own CPU: all it and its children used, less the fresh runners and its children's
    out["warm_process_import_cpu_s"] = round(warm_total - fresh_cpu - children, 2)
    out["warm_process_ready_wall_s"] = round(ready_wall, 2)
    out["rounds"] = args.rounds
    print(json.dumps(out))


if __name__ == "__main__":
    main()
