"""The cleanup of extractions whose reader was killed outright, and of killed `serve-vllm` servers and feature
servers (no vLLM)."""

import importlib.util
import os
import subprocess
import sys
import time

from eagle3_hf.engines.vllm.vllm_env import EXTRACT_PREFIX, remove_orphaned_extractions
from eagle3_hf.engines.vllm.vllm_extract_runner import process_alive
from eagle3_hf.engines.vllm.vllm_feature_launcher import FEATURE_SERVER


def feature_server_script():
    """vllm_feature_server.py as the vLLM venv runs it: a script beside its runner, not a package module."""
    spec = importlib.util.spec_from_file_location("vllm_feature_server_script", FEATURE_SERVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_removes_only_directories_whose_reader_and_runner_both_exited(tmp_path):
    dead = exited_pid()
    both_gone = tmp_path / f"{EXTRACT_PREFIX}gone"
    runner_alive = tmp_path / f"{EXTRACT_PREFIX}runner"
    starting = tmp_path / f"{EXTRACT_PREFIX}starting"  # no pid file yet, just created
    other = tmp_path / "unrelated_dir"
    for d in (both_gone, runner_alive, starting, other):
        d.mkdir()
        (d / "request.json").write_text("{}")
    (both_gone / "pids").write_text(f"{dead} {dead}\n")
    (runner_alive / "pids").write_text(f"{dead} {os.getpid()}\n")
    (other / "pids").write_text(f"{dead} {dead}\n")

    removed = remove_orphaned_extractions(str(tmp_path))

    assert removed == [str(both_gone)]
    assert not both_gone.exists() and runner_alive.exists() and starting.exists() and other.exists()


def test_an_extraction_removes_orphans_at_its_end_too(tmp_path, monkeypatch):
    """A reader killed just before ours started, whose runner was still finishing its last batch then (alive: kept
    at our start), leaves a directory nobody else removes: our extraction's end sweeps again."""
    import tempfile

    from eagle3_hf.engines.vllm.vllm_env import VllmExtraction

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    orphan = tmp_path / f"{EXTRACT_PREFIX}orphan"
    orphan.mkdir()
    (orphan / "pids").write_text(f"{exited_pid()} {exited_pid()}\n")  # both exited while ours ran
    ours = VllmExtraction({}, None)
    ours._tmp, ours._proc = tempfile.TemporaryDirectory(prefix=EXTRACT_PREFIX), None  # as __enter__ leaves them
    ours.__exit__(None, None, None)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_without_pids_is_removed_once_old(tmp_path):
    torn = tmp_path / f"{EXTRACT_PREFIX}torn"
    torn.mkdir()
    old = time.time() - 3600
    os.utime(torn, (old, old))
    assert remove_orphaned_extractions(str(tmp_path)) == [str(torn)]


def test_a_zombie_counts_as_exited():
    alive = process_alive  # the extraction cleanup's and the feature server's rule
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    assert alive(proc.pid)
    deadline = time.monotonic() + 30
    while alive(proc.pid):  # exited but not reaped: a zombie
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert proc.poll() is not None  # reaped only now: it was a zombie while `alive` said gone
    assert not alive(proc.pid)


def test_a_killed_feature_servers_storage_is_removed_by_the_next_start(tmp_path):
    script = feature_server_script()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exited, not reaped: a container without init
    deadline = time.monotonic() + 30
    while open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    killed, running = tmp_path / f"{script.PREFIX}killed", tmp_path / f"{script.PREFIX}running"
    for d, pid in ((killed, zombie.pid), (running, os.getpid())):
        d.mkdir()
        (d / "pid").write_text(f"{pid}\n")
    try:
        assert script.remove_stale(str(tmp_path)) == [str(killed)]
    finally:
        zombie.wait()
    assert running.exists()


def test_a_killed_vllm_servers_storage_and_log_are_removed_by_the_next_start(tmp_path):
    from eagle3_hf.engines.vllm.vllm_openai import STORAGE_PREFIX

    dead = exited_pid()
    killed, running = tmp_path / f"{STORAGE_PREFIX}killed", tmp_path / f"{STORAGE_PREFIX}running"
    for d, pids in ((killed, f"{dead} {dead}"), (running, f"{dead} {os.getpid()}")):
        d.mkdir()
        (d / "pids").write_text(pids + "\n")
        (d / "cmpl-1.safetensors").write_bytes(b"x" * 64)
        (tmp_path / f"{d.name}.log").write_text("vLLM's log\n")

    assert remove_orphaned_extractions(str(tmp_path), prefix=STORAGE_PREFIX) == [str(killed)]
    assert not killed.exists() and not (tmp_path / f"{killed.name}.log").exists()
    assert (running / "cmpl-1.safetensors").exists() and (tmp_path / f"{running.name}.log").exists()
