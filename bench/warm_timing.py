"""What the two warm-start benches share (vllm_warm_start.py, command_warm_start.py): start a warm process
(engines/fork_server.py), then time one job started fresh and one forked from it, alternately, and report the medians,
their ratios and the warm process's own import. CPU seconds are the jobs' own: a fresh process's reaped rusage, a fork's
from the warm process's count (its SOCKET.cpu file)."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO


def reaped_cpu() -> float:
    """CPU seconds of this process's reaped children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def children_cpu(warm_socket: str) -> float:
    """This process's reaped children and the warm process's reaped forks."""
    warm = Path(f"{warm_socket}.cpu")
    return reaped_cpu() + (float(warm.read_text()) if warm.is_file() else 0.0)


def fresh_against_warm(start: Callable[[str, IO[str]], subprocess.Popen], folder: str,
                       run: Callable[[str | None], object], rounds: int) -> dict[str, object]:
    """`start(socket_path, log)` starts the warm process; `run(None)` runs the job as a fresh process, `run(socket)`
    as a fork of it. Both are timed `rounds` times, alternately; the JSON-ready summary."""
    sock, log_path = os.path.join(folder, "warm.sock"), os.path.join(folder, "warm.log")
    cpu0, wall0 = reaped_cpu(), time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        warm = start(sock, log)
    while not os.path.exists(sock):
        if warm.poll() is not None:
            raise SystemExit(f"the warm process exited: {Path(log_path).read_text()[-2000:]}")
        time.sleep(0.1)
    ready_wall = time.perf_counter() - wall0

    def timed(warm_socket: str | None) -> tuple[float, float]:
        c0, w0 = children_cpu(sock), time.perf_counter()
        run(warm_socket)
        return children_cpu(sock) - c0, time.perf_counter() - w0

    runs: dict[str, list[tuple[float, float]]] = {"fresh": [], "warm": []}
    for _ in range(rounds):
        runs["fresh"].append(timed(None))
        runs["warm"].append(timed(sock))
    warm.terminate()
    warm.wait()
    total = reaped_cpu() - cpu0
    cpu = {name: statistics.median(c for c, _ in rows) for name, rows in runs.items()}
    wall = {name: statistics.median(w for _, w in rows) for name, rows in runs.items()}
    out: dict[str, object] = {name: {"cpu_s": round(cpu[name], 2), "wall_s": round(wall[name], 2)} for name in runs}
    out["ratio_cpu_warm_over_fresh"] = round(cpu["warm"] / cpu["fresh"], 3)
    out["ratio_wall_warm_over_fresh"] = round(wall["warm"] / wall["fresh"], 3)
    # the warm process's own CPU: all it and its forks used, less the fresh processes and the forks
    out["warm_process_import_cpu_s"] = round(total - sum(c for rows in runs.values() for c, _ in rows), 2)
    out["warm_process_ready_wall_s"] = round(ready_wall, 2)
    out["rounds"] = rounds
    return out
