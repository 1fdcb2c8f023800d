"""A server this process starts and owns: its own process group, a log file, a wait until it is ready, a stop.

The two vLLM servers (vllm_openai.py `VllmOpenAIServer`, vllm_feature_launcher.py `VllmFeatureServer`) differ
only in what they run, how readiness shows and what they clean up; the process handling is here, once:

- started in its own session (process group), so that a stop reaches every process it forks, and with
  stdout and stderr in one log file (none with `debug`: the terminal's);
- entering polls until `_ready()`; a process that exits first raises `_exit_error(status)`, a process not
  ready within `timeout` seconds raises `_timeout_error()`, both after stopping it (leaving the block);
- `stop()` sends SIGTERM, waits `grace_s`, then SIGKILLs the whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TypeVar

from .vllm.warm_launch import WarmProcess, launch

_S = TypeVar("_S", bound="ServerProcess")


class ServerProcess:
    """The process half of a server context manager; subclasses supply `_start` (prepare, then `_launch`),
    `_ready`, `_exit_error`, `_timeout_error` and `_cleanup` (what goes once the process is stopped)."""

    poll_interval_s = 0.5  # between readiness checks
    # Ask `_ready()` before looking whether the process exited: right when readiness is a file only this
    # process writes (it stays true after an exit); wrong for a port that another server could answer on.
    ready_before_exit_check = False
    # SIGKILL the group even when the leader exited by itself: its children (an engine core, workers) must
    # not outlive it. False: a leader that exits on SIGTERM is trusted to have ended its own children.
    kill_group_after_exit = True

    def __init__(self, timeout: float, debug: bool = False):
        self.timeout, self.debug = timeout, debug
        self._proc: subprocess.Popen | WarmProcess | None = None
        self._log_path: Path | None = None

    # ------------------------------------------------------------ what a subclass supplies

    def _start(self) -> None:
        """Prepare what the process needs, set `_log_path`, then `_launch` it."""
        raise NotImplementedError

    def _ready(self) -> bool:
        """Whether the started process serves yet."""
        raise NotImplementedError

    def _exit_error(self, status: int) -> Exception:
        """The error for a process that exited (with `status`) before it was ready."""
        raise NotImplementedError

    def _timeout_error(self) -> Exception:
        """The error for a process not ready within `timeout` seconds (it is stopped)."""
        raise NotImplementedError

    def _cleanup(self) -> None:
        """What goes once the process is stopped (temporary directories)."""

    # ------------------------------------------------------------ the process

    def _launch(self, argv: list[str], env: dict[str, str], warm: bool = False) -> None:
        """Start `argv` in its own process group, its output into `_log_path` (the terminal with `debug`);
        `warm`: a vLLM runner or API server, forked from the warm vLLM process when one listens (warm_launch.py)."""
        assert self._log_path is not None, "set _log_path before _launch"
        log = None if self.debug else open(self._log_path, "w", encoding="utf-8")
        try:
            err = None if log is None else subprocess.STDOUT
            self._proc = (launch(argv, env, stdout=log, stderr=err, start_new_session=True) if warm else
                          subprocess.Popen(argv, env=env, stdout=log, stderr=err, start_new_session=True))
        finally:
            if log is not None:
                log.close()

    def _log_text(self) -> str:
        path = self._log_path
        return path.read_text(encoding="utf-8", errors="replace") if path and path.is_file() else ""

    @staticmethod
    def _last_line(log: str, status: int) -> str:
        """A log's last non-blank line (what a failing process said last), else the exit status."""
        tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or [f"exit status {status}"]
        return tail[0].strip()

    def _wait_until_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.timeout
        while True:
            if self.ready_before_exit_check and self._ready():
                return
            status = self._proc.poll()
            if status is not None:
                raise self._exit_error(status)
            if not self.ready_before_exit_check and self._ready():
                return
            if time.monotonic() > deadline:
                raise self._timeout_error()
            time.sleep(self.poll_interval_s)

    def __enter__(self: _S) -> _S:
        self._start()
        try:
            self._wait_until_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait(self) -> int:
        """Until the server exits (the CLI's foreground); its exit status."""
        assert self._proc is not None, f"use {type(self).__name__} as a context manager"
        return self._proc.wait()

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM), without waiting: safe inside a signal handler."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM, up to `grace_s` seconds for the server to exit, then SIGKILL of its process group (always
        with `kill_group_after_exit`, else only when it did not exit in time)."""
        proc = self._proc
        if proc is None:
            return
        exited = True
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                exited = False
        if exited and not self.kill_group_after_exit:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._cleanup()
