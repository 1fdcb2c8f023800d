"""Start a vLLM runner as its own process, or as a fork of a warm vLLM process when one is listening.

`EAGLE3_HF_VLLM_WARM=SOCKET` names a warm process (engines/vllm/vllm_warm.py, started by `start_warm`): the runner
then starts with vLLM already imported (about 8 s of one core less per engine). The test suite sets it for its
whole session; without it, or while the warm process is not listening yet, every runner is a fresh process as
users run them. Either way the caller gets the same handle: `pid`, `poll()`, `wait(timeout)`, `send_signal()`,
`kill()`, `returncode`, as `subprocess.Popen` has them.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any

WARM_ENV = "EAGLE3_HF_VLLM_WARM"
WARM_RUNNER = Path(__file__).resolve().parent / "vllm_warm.py"


class WarmProcess:
    """A runner forked by the warm process: not this process's child, so its exit status comes over the socket."""

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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fd(stream: IO[Any] | int | None, default: int) -> int:
    if stream is None:
        return default
    return stream if isinstance(stream, int) else stream.fileno()


def launch(argv: list[str], env: dict[str, str], stdout: IO[Any] | int | None = None,
           stderr: IO[Any] | int | None = None, start_new_session: bool = False) -> subprocess.Popen | WarmProcess:
    """Start `argv` ([vLLM's python, runner script, args...]) with `env`: forked from the warm process named by
    EAGLE3_HF_VLLM_WARM when it listens and takes the job, else a new process. `stderr=subprocess.STDOUT` as
    Popen's."""
    path = os.environ.get(WARM_ENV, "")
    if path and len(argv) > 1 and argv[1].endswith(".py"):
        forked = _fork_from_warm(path, argv, env, stdout, stderr, start_new_session)
        if forked is not None:
            return forked
    return subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr, start_new_session=start_new_session)


def _fork_from_warm(path: str, argv: list[str], env: dict[str, str], stdout: IO[Any] | int | None,
                    stderr: IO[Any] | int | None, new_session: bool) -> WarmProcess | None:
    """The job sent to the warm process (vllm_warm.py's protocol); None when it is not listening or declines."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # not listening (yet, or any more)
        conn.close()
        return None
    out = _fd(stdout, 1)
    err = out if stderr == subprocess.STDOUT else _fd(stderr, 2)
    header = {"python": argv[0], "argv": argv[1:], "env": env, "cwd": os.getcwd(), "new_session": new_session}
    with open(os.devnull, "rb") as null:
        socket.send_fds(conn, [(json.dumps(header) + "\n").encode()], [null.fileno(), out, err])
    answer = b""
    while b"\n" not in answer:
        chunk = conn.recv(4096)
        if not chunk:
            conn.close()
            raise OSError(f"the warm vLLM process ({path}) closed before starting {argv[1]}")
        answer += chunk
    first, rest = answer.split(b"\n", 1)
    started = json.loads(first)
    if "cold" in started:  # an environment the warm process cannot take on
        conn.close()
        return None
    proc = WarmProcess(conn, int(started["pid"]))
    if rest:  # the exit status came with it (a runner that ended at once)
        proc._buffer = rest
        proc._parse()
    return proc


def start_warm(python: str | Path, env: dict[str, str], socket_path: str | Path,
               log: IO[Any] | None = None) -> subprocess.Popen:
    """Start the warm process (it listens on `socket_path` once vLLM is imported); stop it with terminate()."""
    return subprocess.Popen([str(python), str(WARM_RUNNER), str(socket_path)], env=env, stdout=log,
                            stderr=subprocess.STDOUT if log is not None else None, start_new_session=True)
