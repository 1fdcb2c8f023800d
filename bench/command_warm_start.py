"""What the warm process for our own commands (engines/forked.py, EAGLE3_HF_WARM) saves per process: the training
script's `--help` (it imports torch, transformers and the Trainer before it can answer) started as a fresh process
and handed to a fork of the warm process, alternately in one run, --rounds each. CPU seconds are the process's and
its fork's (the process's reaped rusage, the fork's from the warm process's count), wall seconds the caller's; the
warm process's own import is printed beside them (paid once per test session and worker).

    python -m bench.command_warm_start [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3_hf.engines.forked import COMMANDS_WARM_ENV, start_fork_server

from tests.helpers.warm_commands import RUN_TIME_VARIABLES, WARM_IMPORTS

ROOT = Path(__file__).resolve().parents[1]


def children_cpu(warm_socket: str) -> float:
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    warm = Path(f"{warm_socket}.cpu")
    return own.ru_utime + own.ru_stime + (float(warm.read_text()) if warm.is_file() else 0.0)


def timed(env: dict[str, str], warm_socket: str) -> tuple[float, float]:
    cpu0, wall0 = children_cpu(warm_socket), time.perf_counter()
    subprocess.run([sys.executable, str(ROOT / "examples/train.py"), "--help"], env=env, check=True,
                   stdout=subprocess.DEVNULL, cwd=ROOT)
    return children_cpu(warm_socket) - cpu0, time.perf_counter() - wall0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="eagle3_cmd_bench_")
    sock = os.path.join(folder, "warm.sock")
    env = {k: v for k, v in os.environ.items() if k != COMMANDS_WARM_ENV} | {"OMP_NUM_THREADS": "1"}
    cpu0, wall0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with open(os.path.join(folder, "warm.log"), "w", encoding="utf-8") as log:
        warm = start_fork_server(sys.executable, env, sock, WARM_IMPORTS, RUN_TIME_VARIABLES, log)
    while not os.path.exists(sock):
        if warm.poll() is not None:
            raise SystemExit(f"the warm process exited: {Path(folder, 'warm.log').read_text()[-2000:]}")
        time.sleep(0.1)
    ready_wall = time.perf_counter() - wall0
    runs: dict[str, list[tuple[float, float]]] = {"fresh": [], "warm": []}
    for _ in range(args.rounds):
        runs["fresh"].append(timed(env, sock))
        runs["warm"].append(timed(env | {COMMANDS_WARM_ENV: sock}, sock))
    warm.terminate()
    warm.wait()
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = cpu1.ru_utime + cpu1.ru_stime - (cpu0.ru_utime + cpu0.ru_stime)
    fresh_cpu = sum(c for c, _ in runs["fresh"])
    out: dict[str, object] = {name: {"cpu_s": round(statistics.median(c for c, _ in rows), 2),
                                     "wall_s": round(statistics.median(w for _, w in rows), 2)}
                              for name, rows in runs.items()}
    fresh, forked = runs["fresh"], runs["warm"]
    out["ratio_cpu_warm_over_fresh"] = round(statistics.median(c for c, _ in forked) /
                                             statistics.median(c for c, _ in fresh), 3)
    out["ratio_wall_warm_over_fresh"] = round(statistics.median(w for _, w in forked) /
                                              statistics.median(w for _, w in fresh), 3)
    # the warm process's own CPU: all it and its children used, less the fresh processes and the forks
    out["warm_process_import_cpu_s"] = round(total - fresh_cpu - sum(c for c, _ in forked), 2)
    out["warm_process_ready_wall_s"] = round(ready_wall, 2)
    out["rounds"] = args.rounds
    print(json.dumps(out))


if __name__ == "__main__":
    main()
