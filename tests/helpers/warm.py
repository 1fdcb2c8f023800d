"""The session's warm processes (engines/fork_server.py), one of each per worker: started in a short temporary
folder (a Unix socket's path has at most 107 bytes), named to the processes the tests start by an environment
variable, stopped at the session's end. EAGLE3_HF_TEST_WARM_LOG=FILE keeps their logs (which jobs started cold,
and why)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from typing import IO, Any

Started = tuple[Any, str]  # (the warm process, its folder)


def start_warm_process(start: Callable[[str, IO[str]], Any], variable: str) -> Started:
    """`start(socket_path, log)` starts it; `variable` then names its socket to every process started after."""
    folder = tempfile.mkdtemp(prefix="eagle3_warm_")
    path = os.path.join(folder, "warm.sock")
    with open(os.path.join(folder, "warm.log"), "w", encoding="utf-8") as log:
        proc = start(path, log)
    os.environ[variable] = path
    return proc, folder


def stop_warm_process(started: Started | None, variable: str) -> None:
    if started is None:
        return
    proc, folder = started
    os.environ.pop(variable, None)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if os.environ.get("EAGLE3_HF_TEST_WARM_LOG"):
        with open(os.environ["EAGLE3_HF_TEST_WARM_LOG"], "a", encoding="utf-8") as out, \
                open(os.path.join(folder, "warm.log"), encoding="utf-8") as log:
            out.write(log.read())
    shutil.rmtree(folder, ignore_errors=True)
