"""The groups pytest-xdist runs `make test`'s three workers by (-n 3 --dist loadgroup, on two cores): each group
runs on one worker, in order; tests/conftest.py gives xdist the scheduler that reads them.

The tests that keep both cores busy (two or more training, extraction or engine processes at once) are one group, so
no two of them ever run together. The users of a costly session fixture share a group, so one worker builds it once;
every other test is grouped by its module, so a module's fixtures are built once too. The groups are made here from
node ids: xdist 3.8's own `xdist_group` marks are lost under pytest 9.2 (pytest-dev/pytest-xdist#1386); a mark's
group is still honoured where xdist passes it on.
"""

from __future__ import annotations

TWO_CORES = (
    "tests/train/test_trainer.py::test_accelerate_launch_two_cpu_processes",
    "tests/test_faults.py::test_sigkill_during_two_process_zero3_training_then_resume_matches_uninterrupted",
    "tests/train/test_multinode.py::test_two_machines_of_two_processes_train_like_one_process",
    "tests/train/test_two_nodes.py::test_two_nodes_without_a_shared_filesystem",
    "tests/test_rehearsal.py::test_the_kimi_route_on_two_nodes",
    "tests/features/test_extract.py::test_two_ranks_merge_one_manifest",
    "tests/features/test_feature_server.py::test_training_online_from_the_vllm_server_equals_offline",
    "tests/verifier/test_code_cache.py::test_eight_ranks_load_remote_code_into_a_cold_cache_20_times_without_a_failure",
)
# the modules whose tests share a session fixture: `served_pair` trains a drafter, `vllm_evaluation` serves it in
# vLLM once for three tests (tests/evaluation/conftest.py); each module uses one of its group's FIXTURES
SHARED = {"tests/evaluation/test_vllm_engine.py": "served_pair",
          "tests/evaluation/test_engine_layout.py": "served_pair",
          "tests/evaluation/test_llamacpp_engine.py": "served_pair"}
FIXTURES = {"served_pair": ("served_pair", "vllm_evaluation")}
# the longest groups go first, so neither worker is left with a long one at the end (ordering every group of 20 s
# or more longest first measured no faster: 917 s against 889 s, the machine's noise; docs/development.md)
FIRST = ("two_cores", "tests/test_demo.py", "served_pair", "tests/test_rehearsal.py",
         "tests/evaluation/test_dflash_engines.py")  # DFlash served by vLLM and llama.cpp: one worker, in turn


def group(nodeid: str) -> str:
    """The xdist group of a test, from its node id."""
    _, at, name = nodeid.rpartition("@")
    if at and "]" not in name and "::" not in name:  # marked `xdist_group(name)`, where xdist still suffixes it
        return name
    if nodeid.startswith(TWO_CORES):
        return "two_cores"
    module = nodeid.split("::")[0]
    return SHARED.get(module, module)


