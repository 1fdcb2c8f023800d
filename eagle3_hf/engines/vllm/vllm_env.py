"""Find the vLLM venv, give vLLM's CPU backend its environment, run vllm_runner.py there, read its answer.

The venv is `$EAGLE3_HF_VLLM_VENV`, else `~/.cache/eagle3_hf/vllm-venv` (where `make vllm` installs it);
its stamp file records the pinned vLLM. Errors come back as one line (`VllmError`); the runner's full
traceback is kept on the exception and shown with `--debug` / EAGLE3_HF_DEBUG=1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ...errors import Eagle3Error
from ..child_env import engine_environment
from .vllm_args import replica_environment
from .vllm_extract_runner import process_alive
from .vllm_request import GenerationRequest
from .warm_launch import WarmProcess, launch

RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
STAMP = ".eagle3_hf_vllm"
INSTALL_HINT = "vLLM is not installed: run `make vllm`"


class VllmError(Eagle3Error):
    """vLLM missing, or vLLM refused the request; `details` holds the runner's traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


def vllm_venv() -> Path:
    """The vLLM venv directory (it may not exist)."""
    root = os.environ.get("EAGLE3_HF_VLLM_VENV")
    if root:
        return Path(root).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return Path(cache) / "eagle3_hf" / "vllm-venv"


def vllm_python() -> Path:
    """The venv's interpreter; VllmError("vLLM is not installed: run `make vllm`") when the install is absent."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if not (venv / STAMP).is_file() or not python.exists():
        raise VllmError(f"{INSTALL_HINT} (looked in {venv}; EAGLE3_HF_VLLM_VENV overrides)")
    return python


def vllm_environment(venv: Path, threads: int, offline: bool, debug: bool = False) -> dict[str, str]:
    """What vLLM's CPU backend wants, set here so that users never have to: a small KV cache (GiB), no
    thread pinning on a shared machine (pinning to cores that other jobs use makes every thread wait), the
    engine in this process (both engines share it; metrics read directly), our thread count, quiet logs, and
    Intel OpenMP preloaded as vLLM's CPU guide asks.

    It starts from the user's environment less the launcher's per-rank variables (child_env.py): a user's
    setting of these defaults is kept; `offline` (every model is a local path) turns HF_HUB_OFFLINE on, and
    nothing here turns a user's HF_HUB_OFFLINE=1 off."""
    env = engine_environment()
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": str(threads),
        "VLLM_LOGGING_LEVEL": "INFO" if debug else env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": env.get("TOKENIZERS_PARALLELISM", "false"),
        "PYTHONWARNINGS": env.get("PYTHONWARNINGS", "ignore"),
    })
    if offline:  # local paths only: the child never needs the Hub (a user's own setting stands otherwise)
        env["HF_HUB_OFFLINE"] = "1"
    env.pop("PYTHONPATH", None)  # the runner imports only vllm and the standard library
    iomp = venv / "lib" / "libiomp5.so"  # vLLM warns that CPU speculative decoding is much slower without it
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


# Every call to vLLM has a deadline: a hung engine must end as an error, not a process that waits forever.
# One run of `evaluate --engine vllm` (both engines, all prompts) or one extraction batch must finish within it.
DEFAULT_TIMEOUT_S = 4 * 3600.0
TIMEOUT_ENV = "EAGLE3_HF_VLLM_TIMEOUT_S"


def default_timeout() -> float:
    """Seconds a vLLM call may take: $EAGLE3_HF_VLLM_TIMEOUT_S, else DEFAULT_TIMEOUT_S."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise VllmError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise VllmError(f"{TIMEOUT_ENV}={value!r} must be positive")
    return seconds


MAX_LINE = 240
_NOISE = re.compile(r"^\s*(\d+ validation errors? for \w+|For further information.*|See root cause above.*)$")


def one_line(error: dict[str, Any]) -> str:
    """vLLM's exception as one readable line: the pydantic 'Value error, ...' text when there is one, else the
    last meaningful line of the message (vLLM's wrappers say 'see root cause above' on the first)."""
    text = error.get("full_message") or error.get("message") or ""
    value = re.search(r"Value error, (.*?)(?: \[type=|$)", text, re.M)
    if value:
        return value.group(1).strip()[:MAX_LINE]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not _NOISE.match(ln)]
    found = lines[0] if lines else ""
    if not found:  # fall back to the last line of the traceback ("KeyError: 'x'")
        tail = [ln for ln in (error.get("traceback") or "").splitlines() if ln.strip()]
        found = tail[-1].strip() if tail else ""
    if len(found) > MAX_LINE:  # vLLM lists every parameter name of the model in some messages
        found = found[:MAX_LINE].rstrip() + " ..."
    kind = str(error.get("type") or "Error")
    if not found:
        return kind
    return found if found.startswith(kind + ":") else f"{kind}: {found}"


def run_vllm(request: GenerationRequest, threads: int = 1, debug: bool = False, timeout: float | None = None) -> dict:
    """Run one vllm_runner.py request in the vLLM venv; its JSON result, or VllmError with one line.

    The runner is killed after `timeout` seconds (default `default_timeout()`), which is a VllmError too."""
    python = vllm_python()
    timeout = default_timeout() if timeout is None else timeout
    names = [request.verifier, request.drafter]
    offline = all(n is None or Path(str(n)).exists() for n in names)  # repo ids: this process only goes online
    with tempfile.TemporaryDirectory(prefix="eagle3_vllm_") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request.to_json()), encoding="utf-8")
        env = vllm_environment(vllm_venv(), threads, offline, debug)
        log_path = Path(tmp) / "vllm.log"
        with open(log_path, "w", encoding="utf-8") as log_file:
            proc = launch([str(python), str(RUNNER), str(req), str(res)], env, stdout=None if debug else log_file,
                          stderr=None if debug else subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise VllmError(f"vLLM ({python}) did not finish within {timeout:.0f} s and was stopped "
                            f"({TIMEOUT_ENV} sets the limit)", details=log_path.read_text(errors="replace")) from None
        log = log_path.read_text(encoding="utf-8", errors="replace")
        if not res.is_file():
            tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or [f"exit status {proc.returncode}"]
            raise VllmError(f"vLLM ({python}) ended without a result: {tail[0].strip()}", details=log)
        result = json.loads(res.read_text(encoding="utf-8"))
    if "error" in result:
        if debug:
            print(result["error"].get("traceback", ""), file=sys.stderr)
        what = "the drafter" if request.drafter else "the verifier"
        name = request.drafter or request.verifier
        raise VllmError(f"vLLM refused {what} {name}: {one_line(result['error'])}",
                        details=log + "\n" + result["error"].get("traceback", ""))
    return result


# ---------------------------------------------------------------- extraction: a runner that streams files

EXTRACT_RUNNER = Path(__file__).resolve().parent / "vllm_extract_runner.py"


EXTRACT_PREFIX = "eagle3_vllm_extract_"


def remove_orphaned_extractions(root: str, prefix: str = EXTRACT_PREFIX) -> list[str]:
    """Remove the temporary directories of extractions whose reader and runner have both exited: a reader
    killed outright cannot clean up, and a runner that finished before the kill never learns of it. A
    runner still running when its reader dies removes its own files (vllm_extract_runner.reader_gone).
    `prefix`: the same for `serve-vllm`'s storage directories (engines/vllm/vllm_openai.py), log beside included."""
    import shutil
    import time

    removed = []
    for path in Path(root).glob(prefix + "*"):
        if path.suffix == ".log":
            continue
        try:
            pids = [int(p) for p in (path / "pids").read_text(encoding="utf-8").split()]
        except (OSError, ValueError):  # no pid file yet: starting right now, or torn; age decides
            try:
                if time.time() - path.stat().st_mtime < 600:
                    continue
            except OSError:
                continue
            pids = []
        if any(process_alive(pid) for pid in pids):
            continue
        shutil.rmtree(path, ignore_errors=True)
        Path(f"{path}.log").unlink(missing_ok=True)
        removed.append(str(path))
    return removed


class VllmExtraction:
    """vllm_extract_runner.py in the vLLM venv, as a context manager that yields each request's file.

    `prompts` are (key, token ids). The runner prefills them in batches and appends one progress line per
    finished request; `records()` yields them ({"key", "path", "prompt_tokens"}) as they appear. The reader
    deletes each file once it holds it: the runner waits while more than `max_pending` lie in its storage
    directory, so the temporary files never accumulate. No progress for `timeout` seconds (model load
    included) stops the runner and raises VllmError, as does an error inside it (one line). Leaving the
    block stops a runner still running (its process group, which this class started) and removes the
    temporary directory with any file still in it.

    `prompts=None` defers them: with a "generate" request (`regenerate --engine vllm`) the same engine first
    answers rounds of prompts (`generate()`, as often as needed), then `extract(prompts)` hands over the
    samples to prefill and `records()` yields their files as above.
    """

    def __init__(self, request: dict[str, Any], prompts: Iterable[tuple[int, list[int]]] | None, threads: int = 1,
                 debug: bool = False,
                 timeout: float | None = None, storage_dir: str | Path | None = None):
        self.request, self.prompts, self.threads, self.debug = dict(request), prompts, threads, debug
        self.timeout = default_timeout() if timeout is None else float(timeout)
        self.storage_dir = storage_dir
        self.result: dict[str, Any] | None = None
        self.peak_pending_bytes = 0
        self._proc: subprocess.Popen | WarmProcess | None = None
        self._rounds, self._offset, self._buffer = 0, 0, b""

    def __enter__(self) -> VllmExtraction:
        python = vllm_python()
        remove_orphaned_extractions(tempfile.gettempdir())
        self._tmp = tempfile.TemporaryDirectory(prefix=EXTRACT_PREFIX)
        tmp = Path(self._tmp.name)
        self.storage = Path(self.storage_dir) if self.storage_dir else tmp / "states"
        self.storage.mkdir(parents=True, exist_ok=True)
        self._dir = tmp
        if self.prompts is not None:
            self._write_prompts(tmp / "prompts.jsonl", ({"key": k, "ids": ids} for k, ids in self.prompts))
        self._progress, self._result, self._log = tmp / "progress.jsonl", tmp / "result.json", tmp / "vllm.log"
        self._progress.touch()
        request = dict(self.request, storage=str(self.storage), prompts_file=str(tmp / "prompts.jsonl"),
                       progress_file=str(self._progress), starter_pid=os.getpid())
        (tmp / "request.json").write_text(json.dumps(request), encoding="utf-8")
        names = [request.get("verifier")]
        offline = all(n is None or Path(str(n)).exists() for n in names)
        env = vllm_environment(vllm_venv(), self.threads, offline, self.debug)
        env["PYTHONPATH"] = str(EXTRACT_RUNNER.parent)  # vLLM imports our connector by module name
        env.update(replica_environment(dict(request.get("engine") or {})))  # ranks side by side: GPUs by LOCAL_RANK
        self._python = python
        log = None if self.debug else open(self._log, "w", encoding="utf-8")
        try:
            self._proc = launch([str(python), str(EXTRACT_RUNNER), str(tmp / "request.json"), str(self._result)],
                                env, stdout=log, stderr=None if log is None else subprocess.STDOUT,
                                start_new_session=True)
        finally:
            if log is not None:
                log.close()
        (tmp / "pids").write_text(f"{os.getpid()} {self._proc.pid}\n", encoding="utf-8")
        return self

    @staticmethod
    def _write_prompts(path: Path, items: Iterable[dict[str, Any]]) -> None:
        """One JSONL file, renamed into place whole: the runner waits for the name, never reads half of it."""
        part = path.with_name(path.name + ".part")
        with open(part, "w", encoding="utf-8") as f:
            for item in items:
                f.write(json.dumps(dict(item, ids=[int(t) for t in item["ids"]])) + "\n")
        os.replace(part, path)

    def generate(self, prompts: list[tuple[int, list[int], int | None]]) -> dict[int, dict[str, Any]]:
        """One round of the generate phase: (key, prompt ids, seed) -> {key: {"output_ids", "finish_reason"}}.
        VllmError on a failure or a stall, as records()."""
        assert self._proc is not None and self.prompts is None, "generate() needs VllmExtraction(request, None)"
        path = self._dir / f"generate_{self._rounds:04d}.jsonl"
        self._write_prompts(path, ({"key": k, "ids": ids, "seed": seed} for k, ids, seed in prompts))
        round_, self._rounds = self._rounds, self._rounds + 1
        answers: dict[int, dict[str, Any]] = {}
        if not prompts:
            return answers
        for line in self._lines():
            if line.get("round") != round_:
                raise VllmError(f"vLLM's runner answered out of turn: {sorted(line)} during generate round {round_}")
            answers[int(line["key"])] = line
            if len(answers) == len(prompts):
                return answers
        raise VllmError(f"vLLM ({self._python}) ended during generate round {round_}", details=self._log_text())

    def extract(self, prompts: Iterable[tuple[int, list[int]]]) -> None:
        """Ends the generate phase: the samples to prefill (then read `records()`)."""
        assert self._proc is not None and self.prompts is None, "extract() needs VllmExtraction(request, None)"
        self._write_prompts(self._dir / "prompts.jsonl", ({"key": k, "ids": ids} for k, ids in prompts))

    def _pending_bytes(self) -> int:
        total = 0
        for entry in os.scandir(self.storage):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # taken meanwhile
                pass
        return total

    def records(self) -> Iterator[dict[str, Any]]:
        """Each finished request's progress record, in submission order; VllmError on a failure or a stall."""
        for line in self._lines():
            if "round" in line:
                raise VllmError("vLLM's runner sent a generate answer after the prompts to prefill")
            self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes())
            yield line

    def _lines(self) -> Iterator[dict[str, Any]]:
        """The runner's progress lines from where the last reading stopped, until it exits (its result read,
        VllmError if it failed) or stalls past the timeout."""
        import time

        assert self._proc is not None, "use VllmExtraction as a context manager"
        last = time.monotonic()
        while True:
            with open(self._progress, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
            self._offset += len(chunk)
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                if line.strip():
                    last = time.monotonic()
                    yield json.loads(line)
            if lines:
                continue
            status = self._proc.poll()
            if status is not None:
                with open(self._progress, "rb") as f:
                    f.seek(self._offset)
                    if f.read().strip():
                        continue  # lines written just before the exit
                self._finish(status)
                return
            if time.monotonic() - last > self.timeout:
                self._stop()
                raise VllmError(f"vLLM ({self._python}) made no progress for {self.timeout:.0f} s and was stopped "
                                f"({TIMEOUT_ENV} sets the limit)", details=self._log_text())
            time.sleep(0.02)

    def _log_text(self) -> str:
        return self._log.read_text(encoding="utf-8", errors="replace") if self._log.is_file() else ""

    def _finish(self, status: int) -> None:
        log = self._log_text()
        if not self._result.is_file():
            tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or [f"exit status {status}"]
            raise VllmError(f"vLLM ({self._python}) ended without a result: {tail[0].strip()}", details=log)
        result = json.loads(self._result.read_text(encoding="utf-8"))
        if "error" in result:
            if self.debug:
                print(result["error"].get("traceback", ""), file=sys.stderr)
            raise VllmError(f"vLLM refused the verifier {self.request.get('verifier')}: {one_line(result['error'])}",
                            details=log + "\n" + result["error"].get("traceback", ""))
        self.result = result

    def _stop(self) -> None:
        import signal

        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # the runner's own session: it and its workers
            except ProcessLookupError:
                pass
            self._proc.wait()

    def __exit__(self, *exc: object) -> None:
        try:
            self._stop()
        finally:
            self._tmp.cleanup()
            # and once more at the end: an extraction killed just before this one started, whose runner was still
            # finishing its last batch then (alive, so kept), has exited by now
            remove_orphaned_extractions(tempfile.gettempdir())
