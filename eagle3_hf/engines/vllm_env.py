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
from pathlib import Path
from typing import Any

from ..errors import Eagle3Error

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
    Intel OpenMP preloaded as vLLM's CPU guide asks."""
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": str(threads),
        "VLLM_LOGGING_LEVEL": "INFO" if debug else os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "PYTHONWARNINGS": "ignore",
    })
    env.pop("PYTHONPATH", None)  # the runner imports only vllm and the standard library
    iomp = venv / "lib" / "libiomp5.so"  # vLLM warns that CPU speculative decoding is much slower without it
    if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (str(iomp), env.get("LD_PRELOAD", "")) if p)
    return env


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


def run_vllm(request: dict[str, Any], threads: int = 1, debug: bool = False, timeout: float | None = None) -> dict:
    """Run one vllm_runner.py request in the vLLM venv; its JSON result, or VllmError with one line."""
    python = vllm_python()
    names = [request.get("verifier"), request.get("drafter")]
    offline = all(n is None or Path(str(n)).exists() for n in names)  # repo ids: this process only goes online
    with tempfile.TemporaryDirectory(prefix="eagle3_vllm_") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request), encoding="utf-8")
        env = vllm_environment(vllm_venv(), threads, offline, debug)
        proc = subprocess.run([str(python), str(RUNNER), str(req), str(res)], env=env,
                              stdout=None if debug else subprocess.PIPE, stderr=None if debug else subprocess.STDOUT,
                              text=True, timeout=timeout)
        log = proc.stdout or ""
        if not res.is_file():
            tail = [ln for ln in log.splitlines() if ln.strip()][-1:] or [f"exit status {proc.returncode}"]
            raise VllmError(f"vLLM ({python}) ended without a result: {tail[0].strip()}", details=log)
        result = json.loads(res.read_text(encoding="utf-8"))
    if "error" in result:
        if debug:
            print(result["error"].get("traceback", ""), file=sys.stderr)
        what = "the drafter" if request.get("drafter") else "the verifier"
        name = request.get("drafter") or request.get("verifier")
        raise VllmError(f"vLLM refused {what} {name}: {one_line(result['error'])}",
                        details=log + "\n" + result["error"].get("traceback", ""))
    return result
