"""Start and stop vllm_feature_server.py (the feature server: vLLM kept loaded) in the vLLM venv.

The server script runs inside the vLLM venv and never imports this package; this is its launcher on our side
(`eagle3-hf serve-features`, features/commands/serve_features.py): the request file, the venv's environment, the process
(server_process.py), and the ready/error files through which the script says it listens or why it failed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ...constants import API_KEY_ENV
from ..server_process import ServerProcess
from .vllm_env import TIMEOUT_ENV, VllmError, default_timeout, one_line, vllm_environment, vllm_python, vllm_venv

FEATURE_SERVER = Path(__file__).resolve().parent / "vllm_feature_server.py"


class VllmFeatureServer(ServerProcess):
    """vllm_feature_server.py in the vLLM venv, started and stopped as a context manager.

    `request` is the server's (vllm_feature_server.py's docstring): the verifier, dtype, max_model_len,
    layer_ids, aux_layer_indices, tokenizer_fingerprint, host, port (0: any free one), batch_size. `api_key`
    reaches the server through its environment ($EAGLE3_HF_API_KEY), never the request file. Entering
    waits until the server listens (model load included, at most `timeout` seconds) and sets `url` and
    `identity`; a server that fails to start is a VllmError with one line. Leaving stops it (SIGTERM, then
    SIGKILL of its process group after 30 s); its storage directory goes with it, and a server killed
    outright leaves a directory the next start removes.
    """

    poll_interval_s = 0.1
    ready_before_exit_check = True  # the ready file is written by this server only, and stays once written
    kill_group_after_exit = False  # on SIGTERM the server removes its storage directory and ends its engine

    def __init__(self, request: dict[str, Any], threads: int = 1, debug: bool = False,
                 timeout: float | None = None, log_file: str | Path | None = None, api_key: str | None = None):
        self.request, self.threads, self.api_key = dict(request), threads, api_key
        super().__init__(default_timeout() if timeout is None else float(timeout), debug)
        self.log_file = log_file
        self.url = ""
        self.identity: dict[str, Any] = {}

    def _start(self) -> None:
        python = vllm_python()
        self._tmp = tempfile.TemporaryDirectory(prefix="eagle3_feature_launch_")
        tmp = Path(self._tmp.name)
        self._ready_file, self._error_file = tmp / "ready.json", tmp / "error.json"
        self._log_path = Path(self.log_file) if self.log_file else tmp / "server.log"
        request = dict(self.request, ready_file=str(self._ready_file), error_file=str(self._error_file),
                       starter_pid=os.getpid())
        (tmp / "request.json").write_text(json.dumps(request), encoding="utf-8")
        offline = Path(str(request.get("verifier"))).exists()
        env = vllm_environment(vllm_venv(), self.threads, offline, self.debug)
        env["PYTHONPATH"] = str(FEATURE_SERVER.parent)  # vLLM imports our connector by module name
        env.pop(API_KEY_ENV, None)  # the server's key is exactly the one given here (none: loopback only)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        self._python = python
        self._launch([str(python), str(FEATURE_SERVER), str(tmp / "request.json")], env, warm=True)

    def __enter__(self) -> VllmFeatureServer:
        super().__enter__()
        answer = json.loads(self._ready_file.read_text(encoding="utf-8"))
        self.url, self.identity, self.storage = answer["url"], answer["identity"], answer["storage"]
        return self

    def _ready(self) -> bool:
        return self._ready_file.is_file()

    def _exit_error(self, status: int) -> VllmError:
        log = self._log_text()
        if self._error_file.is_file():
            found = json.loads(self._error_file.read_text(encoding="utf-8"))["error"]
            return VllmError(f"vLLM refused the verifier {self.request.get('verifier')}: {one_line(found)}",
                             details=log + "\n" + found.get("traceback", ""))
        return VllmError(f"the feature server ({self._python}) ended before listening: {self._last_line(log, status)}",
                         details=log)

    def _timeout_error(self) -> VllmError:
        return VllmError(f"the feature server ({self._python}) was not listening within {self.timeout:.0f} s "
                         f"and was stopped ({TIMEOUT_ENV} sets the limit)", details=self._log_text())

    def _cleanup(self) -> None:
        self._tmp.cleanup()
