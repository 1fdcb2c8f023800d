"""Where the suite's CPU goes: each test's CPU seconds (its process and the children it waited for), one JSON line
per test, when `EAGLE3_HF_TEST_CPU_LOG=FILE` is set (every xdist worker appends to the same file).

The suite is bound by CPU time on two cores, not by scheduling (docs/development.md), so what a cut is worth is
read in CPU seconds, not wall seconds. A test's own subprocesses and engines count once they are reaped, so a session
fixture's engine lands on the test that set it up (its setup) or on the one that tore it down. The runners forked
from the session's warm vLLM process (tests/helpers/vllm.py) are its children, not the test's: their CPU seconds,
which it sums for us, count among the test's children all the same.
`python scripts/cpu_table.py FILE` turns the lines into docs/development.md's table.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Generator
from pathlib import Path

import pytest

LOG_VARIABLE = "EAGLE3_HF_TEST_CPU_LOG"


def _warm_children_seconds() -> float:
    """CPU seconds of the processes the warm processes reaped so far (engines/fork_server.py writes them)."""
    from eagle3_hf.engines.forked import COMMANDS_WARM_ENV
    from eagle3_hf.engines.vllm.warm_launch import WARM_ENV

    total = 0.0
    for path in filter(None, (os.environ.get(WARM_ENV), os.environ.get(COMMANDS_WARM_ENV))):
        try:
            total += float(Path(path + ".cpu").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
    return total


def _cpu_seconds() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime + _warm_children_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    path = os.environ.get(LOG_VARIABLE)
    if not path:
        yield
        return
    own0, children0 = _cpu_seconds()
    wall0 = time.perf_counter()
    yield
    own1, children1 = _cpu_seconds()
    record = {"test": item.nodeid, "wall": round(time.perf_counter() - wall0, 3), "cpu_own": round(own1 - own0, 3),
              "cpu_children": round(children1 - children0, 3),
              # which worker ran it and when it ended: how the workers' last groups line up (the suite's tail)
              "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "ended": round(time.time(), 1)}
    with open(path, "a", encoding="utf-8") as out:  # one short write per line: workers' lines never interleave
        out.write(json.dumps(record) + "\n")
