"""The warm process (engines/fork_server.py) and the entry that hands a process's job to it (engines/forked.py):
a forked job must be what a fresh process would be (argv, environment, working directory, streams, exit status,
signals, a kill), and a job it cannot be (an import-time variable, a start-up hook on PYTHONPATH) starts fresh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_hf.engines.forked import COMMANDS_WARM_ENV, start_fork_server

ROOT = Path(__file__).resolve().parents[2]

ENTRY = """\
import os, signal, sys, time
from eagle3_hf.engines.forked import run_entry_in_warm

run_entry_in_warm()
print("pid", os.getpid(), flush=True)
print("cwd", os.getcwd(), "argv", sys.argv[1:], "x", os.environ.get("JOB_X"), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "kill-self":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(3)))
if mode in ("term", "sleep"):
    Path = __import__("pathlib").Path
    Path(sys.argv[2]).write_text(str(os.getpid()))
    time.sleep(60)
if mode == "stdin":
    print("read", sys.stdin.read().strip())
"""


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A warm process of this venv (warming little: what is forked, not what is imported, is tested here)."""
    folder = tmp_path_factory.mktemp("warm")
    path = Path("/tmp") / f"fork_test_{os.getpid()}.sock"  # short: at most 107 bytes
    env = {k: v for k, v in os.environ.items() if k != COMMANDS_WARM_ENV} | {"PYTHONPATH": str(ROOT)}
    with open(folder / "log", "w") as log:
        proc = start_fork_server(sys.executable, env, path, ["json", "eagle3_hf.cli"], ["JOB_X"], log)
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), (folder / "log").read_text()
    yield {"socket": str(path), "env": env, "log": folder / "log"}
    proc.terminate()
    proc.wait(timeout=30)


def start(warm, tmp_path, *args, **env):
    script = tmp_path / "entry.py"
    script.write_text(ENTRY)
    environment = warm["env"] | {COMMANDS_WARM_ENV: warm["socket"]} | env
    return subprocess.Popen([sys.executable, str(script), *args], cwd=tmp_path, env=environment,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def job_pid(out: str) -> int:
    return int(out.split()[1])


def test_a_forked_job_is_the_process_it_stands_for(warm, tmp_path):
    proc = start(warm, tmp_path, "exit", "7", JOB_X="run-time")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7
    assert job_pid(out) != proc.pid  # a fork of the warm process did the work
    assert f"cwd {tmp_path} argv ['exit', '7'] x run-time" in out and err == "to stderr\n"


def test_stdin_reaches_the_job(warm, tmp_path):
    proc = start(warm, tmp_path, "stdin")
    out, _ = proc.communicate("hello\n", timeout=60)
    assert proc.returncode == 0 and job_pid(out) != proc.pid and "read hello" in out


def test_a_job_killed_by_a_signal_kills_its_caller_with_it(warm, tmp_path):
    proc = start(warm, tmp_path, "kill-self")
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def test_sigterm_to_the_caller_reaches_the_job(warm, tmp_path):
    proc = start(warm, tmp_path, "term", str(tmp_path / "pid"))
    wait_for(tmp_path / "pid")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert "got SIGTERM" in out and proc.returncode == 3


def test_killing_the_caller_kills_the_job(warm, tmp_path):
    proc = start(warm, tmp_path, "sleep", str(tmp_path / "pid"))
    pid = int(wait_for(tmp_path / "pid"))
    assert pid != proc.pid
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid), "the forked job outlived its killed caller"


def test_an_import_time_variable_or_a_start_up_hook_starts_fresh(warm, tmp_path):
    proc = start(warm, tmp_path, "exit", "0", HF_ENDPOINT="http://127.0.0.1:1")  # read by huggingface_hub's import
    out, _ = proc.communicate(timeout=60)
    assert job_pid(out) == proc.pid
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text("")
    proc = start(warm, tmp_path, "exit", "0", PYTHONPATH=f"{ROOT}{os.pathsep}{hooks}")
    out, _ = proc.communicate(timeout=60)
    assert job_pid(out) == proc.pid
    proc = start(warm, tmp_path, "exit", "0", PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path / 'nothing'}")
    out, _ = proc.communicate(timeout=60)
    assert job_pid(out) != proc.pid  # a PYTHONPATH that shadows nothing imported is no reason
    assert "cold start: HF_ENDPOINT differ" in warm["log"].read_text()


def test_a_module_run_as_main_is_not_also_imported(warm, tmp_path):
    env = warm["env"] | {COMMANDS_WARM_ENV: warm["socket"]}
    proc = subprocess.run([sys.executable, "-m", "eagle3_hf.cli", "no-such-command"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'no-such-command'" in proc.stderr
    assert "RuntimeWarning" not in proc.stderr


def test_an_entry_run_in_process_by_another_program_stays_in_it(warm, tmp_path):
    """A test (or any program) that runs the entry script in-process with an argv of its own must not hand its
    own process over: only a process started to run the entry does."""
    script = tmp_path / "entry.py"
    script.write_text(ENTRY)
    code = (f"import runpy, sys\nsys.argv = [{str(script)!r}, 'exit', '5']\n"
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    env = warm["env"] | {COMMANDS_WARM_ENV: warm["socket"]}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 5 and job_pid(out) == proc.pid


def test_a_warm_process_ends_with_the_process_that_started_it(tmp_path):
    starter = ("import sys, time\nfrom eagle3_hf.engines.forked import start_fork_server\n"
               f"p = start_fork_server(sys.executable, {{}}, {str(tmp_path / 's.sock')!r}, ['json'])\n"
               "print(p.pid, flush=True)\ntime.sleep(1)")
    out = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    pid = int(out.split()[0])
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), "the warm process outlived the process that started it"


def wait_for(path: Path) -> str:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.read_text()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
