"""A verifier's own code loaded by the ranks of one launch: one process at a time, local rank 0 first
(verifier/code_cache.py), so that a cold modules cache is never read while another rank rewrites it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eagle3_hf.verifier import code_cache
from eagle3_hf.verifier.code_cache import first_marker, one_loader_at_a_time

from tests.helpers.remote_code_race import write_verifier

ROOT = Path(__file__).resolve().parents[2]


def launch(local_rank: int, world: int = 2) -> dict[str, str]:
    return {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(world), "TORCHELASTIC_RUN_ID": "test-run"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(code_cache, "modules_cache", lambda: tmp_path / "modules")
    monkeypatch.setattr(code_cache.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def test_no_marker_outside_a_launch_of_several_local_ranks():
    assert first_marker({}) is None
    assert first_marker({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) is None
    assert first_marker(launch(1)) == first_marker(launch(0))  # the ranks of one launch share it


def test_the_other_ranks_wait_for_local_rank_0s_first_load(cache):
    order: list[str] = []

    def rank(local_rank: int, delay: float) -> None:
        time.sleep(delay)
        with one_loader_at_a_time(launch(local_rank), wait_s=30):
            order.append(f"in {local_rank}")
            time.sleep(0.2)
            order.append(f"out {local_rank}")

    threads = [threading.Thread(target=rank, args=(1, 0.0)), threading.Thread(target=rank, args=(0, 0.5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == ["in 0", "out 0", "in 1", "out 1"]  # rank 1 started first and still went second
    assert first_marker(launch(0)).exists()


def test_loads_never_overlap(cache):
    """The lock is a file lock: separate processes (the ranks) exclude each other, not only threads."""
    script = ("import sys, time; from pathlib import Path\n"
              "from eagle3_hf.verifier import code_cache\n"
              f"code_cache.modules_cache = lambda: Path({str(cache / 'modules')!r})\n"
              "with code_cache.one_loader_at_a_time({}):\n"
              "    open(sys.argv[1], 'a').write('in\\n'); time.sleep(0.3); open(sys.argv[1], 'a').write('out\\n')\n")
    log = cache / "log"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(log)], env=env) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert log.read_text().split() == ["in", "out"] * 3


def test_rank_0_failing_to_load_still_lets_the_others_go(cache):
    with pytest.raises(ValueError):
        with one_loader_at_a_time(launch(0)):
            raise ValueError("no such file")
    start = time.monotonic()
    with one_loader_at_a_time(launch(1), wait_s=30):
        pass
    assert time.monotonic() - start < 5


@pytest.mark.slow
def test_eight_ranks_load_remote_code_into_a_cold_cache_20_times_without_a_failure(tmp_path):
    """`torchrun --nproc-per-node 8` on the CPU, an empty HF_MODULES_CACHE, 20 verifiers with their own config code,
    each opened by all 8 ranks at once after a gloo barrier: no rank fails (without code_cache.py the same launch
    fails some loads: AttributeError, a class missing from a half-copied module)."""
    reps = 20
    for rep in range(reps):
        write_verifier(tmp_path / f"v{rep}")
    out = tmp_path / "failures.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                           str(ROOT / "tests" / "helpers" / "remote_code_race.py"), "project", str(tmp_path),
                           str(reps), str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(out.read_text())
    assert len(failures) == 8 and failures == [[]] * 8, failures
    assert len(list((tmp_path / "modules" / "transformers_modules").iterdir())) >= reps
