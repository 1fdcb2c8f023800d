"""The per-test CPU recorder (tests/helpers/cpu_seconds.py) and docs/development.md's table made from it
(scripts/cpu_table.py): what the suite's speed work is measured with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import cpu_table  # noqa: E402  (a script, not a module of the package)

INNER = '''
import subprocess, sys, time

SPIN = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"

def test_busy_child():
    subprocess.run([sys.executable, "-c", SPIN], check=True)

def test_idle():
    time.sleep(0.3)
'''


def test_each_test_gets_its_own_and_its_childrens_cpu_seconds(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    log = tmp_path / "cpu.jsonl"
    env = {**os.environ, "EAGLE3_HF_TEST_CPU_LOG": str(log), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.cpu_seconds", "-p",
                           "no:cacheprovider", "test_inner.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    records = {r["test"]: r for r in map(json.loads, log.read_text().splitlines())}
    busy, idle = records["test_inner.py::test_busy_child"], records["test_inner.py::test_idle"]
    assert busy["cpu_children"] >= 0.5  # the child's loop, counted once it was reaped
    assert idle["cpu_own"] + idle["cpu_children"] < 0.2 and idle["wall"] >= 0.3  # sleeping costs wall, not CPU

    table = cpu_table.cpu_table(cpu_table.read_records(log))
    rows = [line for line in table.splitlines() if line.startswith("| `test_inner.py::")]
    assert rows[0].startswith("| `test_inner.py::test_busy_child`")  # the costliest first


def test_table_is_written_between_its_markers_only(tmp_path):
    doc = tmp_path / "development.md"
    doc.write_text(f"before\n{cpu_table.BEGIN}\nold table\n{cpu_table.END}\nafter\n")
    log = tmp_path / "cpu.jsonl"
    log.write_text(json.dumps({"test": "tests/a.py::t", "wall": 2.0, "cpu_own": 1.5, "cpu_children": 0.5}) + "\n")
    assert cpu_table.main([str(log), "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old table" not in text
    assert "| `tests/a.py::t` | 2.0 | 2.0 | 100.0% |" in text


def test_each_workers_end_is_measured_from_the_first_start():
    """The tail line: when each worker's last test ended, counted from the earliest start of any test."""
    records = [{"test": "a::x", "wall": 10.0, "cpu_own": 1.0, "cpu_children": 0.0, "worker": "gw0", "ended": 110.0},
               {"test": "a::y", "wall": 5.0, "cpu_own": 1.0, "cpu_children": 0.0, "worker": "gw1", "ended": 150.0},
               {"test": "a::z", "wall": 30.0, "cpu_own": 1.0, "cpu_children": 0.0, "worker": "gw0", "ended": 140.0}]
    assert cpu_table.worker_ends(records) == {"gw0": 40.0, "gw1": 50.0}
    assert "gw0 40 s, gw1 50 s" in cpu_table.cpu_table(records)
    assert "Workers" not in cpu_table.cpu_table([{k: v for k, v in r.items() if k != "ended"} for r in records])
