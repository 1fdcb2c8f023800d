"""Start a process as a fork of a warm process (engines/fork_server.py) when one listens, else as a new process.

Two warm processes use it: the vLLM runners' (engines/vllm/warm_launch.py, `EAGLE3_HF_VLLM_WARM`) and our own
commands' (`EAGLE3_HF_WARM`: `eagle3-hf ...`, `python -m eagle3_hf.cli ...` and the training script become forks
of a process with torch and transformers imported, `run_entry_in_warm`). The test suite sets both for its whole
session; without them, or while a warm process is not listening yet, every process is a fresh one, as users run
them. A caller gets the same handle either way: `pid`, `poll()`, `wait(timeout)`, `send_signal()`, `kill()`,
`returncode`, as `subprocess.Popen` has them.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

FORK_SERVER = Path(__file__).resolve().parent / "fork_server.py"
COMMANDS_WARM_ENV = "EAGLE3_HF_WARM"  # our own commands' warm process (a socket path)
JOB_ENV = "EAGLE3_HF_WARM_JOB"  # set by fork_server.py in a job: the pid that already runs there


class WarmProcess:
    """A process forked by the warm process: not this process's child, so its exit status comes over the socket."""

    def __init__(self, conn: socket.socket, pid: int):
        self._conn, self.pid = conn, pid
        self.returncode: int | None = None
        self._buffer = b""

    def _read_status(self, timeout: float | None) -> None:
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return
        chunk = self._conn.recv(4096)
        if not chunk:  # the warm process died: its children died with it or run on unreaped
            self.returncode = -signal.SIGKILL if not _alive(self.pid) else None
            if self.returncode is None:
                self._wait_gone(timeout)
            return
        self._buffer += chunk
        self._parse()

    def _parse(self) -> None:
        if self._buffer.endswith(b"\n"):
            self.returncode = int(json.loads(self._buffer.splitlines()[-1])["status"])
            self._conn.close()

    def _wait_gone(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while _alive(self.pid):
            if deadline is not None and time.monotonic() > deadline:
                return
            time.sleep(0.05)
        self.returncode = -signal.SIGKILL

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            self._read_status(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _alive(pid: int) -> bool:
    """The extraction cleanup's rule (a zombie counts as exited), imported only on the rare path that needs it: the
    warm process died, so nobody may reap its forks."""
    from .vllm.vllm_extract_runner import process_alive

    return process_alive(pid)


def _fd(stream: IO[Any] | int | None, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


def fork_from_warm(path: str, job: dict[str, Any], stdout: IO[Any] | int | None = None,
                   stderr: IO[Any] | int | None = None, stdin: int | None = None) -> WarmProcess | None:
    """Send `job` (fork_server.py's header, less the cwd this process has) to the warm process at `path`: its
    handle once forked, None when it is not listening or declines (then start the job as a new process).
    `stderr=subprocess.STDOUT` as Popen's; stdin is /dev/null unless given."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # not listening (yet, or any more)
        conn.close()
        return None
    out = _fd(stdout, 1)
    err = out if stderr == subprocess.STDOUT else _fd(stderr, 2)
    header = {"cwd": os.getcwd(), **job}
    with open(os.devnull, "rb") as null:
        socket.send_fds(conn, [(json.dumps(header) + "\n").encode()], [null.fileno() if stdin is None else stdin,
                                                                        out, err])
    answer = b""
    while b"\n" not in answer:
        chunk = conn.recv(4096)
        if not chunk:
            conn.close()
            raise OSError(f"the warm process ({path}) closed before starting {job['argv'][0]}")
        answer += chunk
    first, rest = answer.split(b"\n", 1)
    started = json.loads(first)
    if "cold" in started:  # a job the warm process cannot take on
        conn.close()
        return None
    proc = WarmProcess(conn, int(started["pid"]))
    if rest:  # the exit status came with it (a process that ended at once)
        proc._buffer = rest
        proc._parse()
    return proc


def start_fork_server(python: str | Path, env: dict[str, str], socket_path: str | Path, warm: list[str],
                      run_time_variables: Sequence[str] = (), log: IO[Any] | None = None) -> subprocess.Popen:
    """Start a warm process importing `warm` (it listens on `socket_path` once they are imported); stop it with
    terminate()."""
    argv = [str(python), str(FORK_SERVER), str(socket_path), "--warm", *warm]
    if run_time_variables:
        argv += ["--run-time-variables", *run_time_variables]
    return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                            start_new_session=True)


def started_as_entry() -> dict[str, str] | None:
    """What this interpreter was started to run, {"path": script} or {"module": name}, when its command line
    (`sys.orig_argv`) is interpreter options, then that script or `-m` module, then this very `sys.argv[1:]`; None
    for anything else (`-c`, a session, a script or a test that runs the entry in-process with an argv of its own)."""
    orig = list(getattr(sys, "orig_argv", []))[1:]
    i = 0
    while i < len(orig) and orig[i].startswith("-") and orig[i] not in ("-", "-c", "-m"):
        i += 2 if orig[i] in ("-W", "-X") else 1  # an option and, for these two, its value
    if i >= len(orig) or orig[i] in ("-", "-c") or (orig[i] == "-m" and i + 1 >= len(orig)):
        return None
    run, rest = ({"module": orig[i + 1]}, orig[i + 2:]) if orig[i] == "-m" else ({"path": orig[i]}, orig[i + 1:])
    if rest != sys.argv[1:]:
        return None
    if "path" in run:
        run["path"] = os.path.abspath(run["path"])
        return run if os.path.abspath(sys.argv[0]) == run["path"] else None
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return run if spec is not None and spec.name == run["module"] else None


# signals a process started from a shell or a test is sent, forwarded to the fork that does its work
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def run_entry_in_warm() -> None:
    """At a process's entry point (`eagle3-hf`, `python -m eagle3_hf.cli`, the training script), before its heavy
    imports: when EAGLE3_HF_WARM names a warm process that takes this very process's job (its argv, environment,
    working directory, streams and interpreter options), let a fork of it do the work and exit with its status;
    else return, and this process does it. Signals sent here go to the fork; a kill of this process kills it."""
    path = os.environ.get(COMMANDS_WARM_ENV, "")
    if not path or os.environ.get(JOB_ENV) == str(os.getpid()):
        return
    run = started_as_entry()
    if run is None:  # this code runs inside another program (a test calling the entry in-process): it stays there
        return
    from .fork_server import interpreter_flags

    job = {"python": sys.executable, "run": run, "argv": sys.argv, "env": dict(os.environ), "tied": True,
           "flags": interpreter_flags(), "unbuffered": bool(getattr(sys.stdout, "write_through", False))}
    try:
        proc = fork_from_warm(path, job, stdout=1, stderr=2, stdin=0)
    except OSError:
        return
    if proc is None:
        return
    for sig in FORWARDED:
        signal.signal(sig, lambda number, _frame: proc.send_signal(number))
    status = proc.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    if status < 0:  # died of a signal: so does this process
        if -status != signal.SIGKILL:
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status)
