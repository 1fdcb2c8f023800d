"""The groups `make test` runs its workers by (tests/conftest.py): every test named as keeping both cores busy
exists (a renamed one would silently leave the group and run beside another), and the grouping keeps what it must
together (tests/helpers/xdist_groups.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.xdist_groups import FIRST, FIXTURES, SHARED, TWO_CORES, group

ROOT = Path(__file__).resolve().parents[1]


def defined_tests(module: Path) -> set[str]:
    return {node.name for node in ast.parse(module.read_text(encoding="utf-8")).body
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_two_core_test_and_shared_module_exists():
    for nodeid in TWO_CORES:
        module, _, name = nodeid.partition("::")
        assert name in defined_tests(ROOT / module), f"{nodeid} is no test: update TWO_CORES in tests/conftest.py"
    for module, name in SHARED.items():  # each module still uses a fixture its group is there to share
        text = (ROOT / module).read_text(encoding="utf-8") if (ROOT / module).is_file() else ""
        assert any(fixture in text for fixture in FIXTURES[name]), (module, name)
    assert FIRST[0] == "two_cores" and len(set(FIRST)) == len(FIRST)
    for name in FIRST:  # a renamed module would silently fall back to collection order
        assert name in ("two_cores", *FIXTURES) or (ROOT / name).is_file(), name


def test_groups():
    assert group("tests/train/test_trainer.py::test_accelerate_launch_two_cpu_processes[zero3-29613]") == "two_cores"
    assert group("tests/train/test_trainer.py::test_sigkill_and_resume_matches_uninterrupted_run") == \
        "tests/train/test_trainer.py"  # one process: beside anything
    assert group("tests/evaluation/test_engine_layout.py::test_x") == group(
        "tests/evaluation/test_vllm_engine.py::test_y") == "served_pair"
    assert group("tests/a.py::test_b[x@y]") == "tests/a.py"  # an @ inside a parameter is no group
    assert group("tests/a.py::test_b@heavy") == "heavy"  # a mark's group, where xdist passes it on
