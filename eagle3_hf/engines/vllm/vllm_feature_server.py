"""A feature server: vLLM loaded once with extract_hidden_states, answering HTTP requests on one address.

Runs inside the vLLM venv, executed by path (standard library, torch, safetensors and vllm; never eagle3_hf),
with vllm_extract_runner.py beside it supplying the engine (`load_llm`: the same LLM, connector and prefill
settings as `extract --engine vllm`) and `wait_written`. Started by `eagle3-hf serve-features`
(engines/vllm/vllm_feature_launcher.py `VllmFeatureServer`); a trainer with `--features URL` is its client
(features/routes/feature_server_client.py).

    python vllm_feature_server.py REQUEST.json

Endpoints:
  GET  /identity   JSON: what is served (verifier, verifier_identity {config_sha256, head_sha256},
                   hidden_size, num_hidden_layers, vocab_size, layer_ids, aux_layer_indices,
                   tokenizer_fingerprint, dtype, max_model_len, vllm_version, connector)
  GET  /health     JSON: {"ok": true, "requests": n, "tokens": n}
  POST /features   body JSON {"ids": [token ids]} -> 200, application/octet-stream: the safetensors file
                   vLLM's connector wrote ({hidden_states [T, len(layer_ids), hidden], token_ids [T]}), deleted
                   here once read; 400 {"error"} for a bad request (ids not integers in 0..vocab_size-1, more
                   than max_model_len - 1 of them), 503 {"error"} with Retry-After when `max_queue` requests
                   already wait, 500 {"error"} when vLLM failed.

Who may ask: with an API key ($EAGLE3_HF_API_KEY in this process's environment, never in the request file)
every endpoint answers 401 unless the request carries `Authorization: Bearer KEY`; without one the server
refuses to listen on anything but loopback. A request is checked whole before it joins a batch, so a bad
one is answered alone and the others of its batch are not touched.

Requests that arrive together are prefilled in one `generate` call (at most `batch_size`, gathered for
`batch_wait_ms`); one engine thread owns vLLM. Files live in this server's own temporary directory
(PREFIX + random, with its pid): each is deleted as soon as it is read, the directory at exit, and a start
removes the directories of servers that died without cleaning up (SIGKILL). The server stops when the
process that started it exits (`watch_parent`), on SIGTERM or SIGINT. Token ids are never logged.
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import ipaddress
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from vllm_extract_runner import Starter, load_llm, prefill_params, process_alive, wait_written  # noqa: E402  (this directory, above)
from vllm_runner import error_result  # noqa: E402

PREFIX = "eagle3_feature_server_"
MAX_BODY = 64 << 20  # a request is token ids as JSON: 64 MiB is millions of tokens
API_KEY_ENV = "EAGLE3_HF_API_KEY"  # eagle3_hf.constants.API_KEY_ENV (this script never imports the package)
MAX_QUEUE = 64  # requests waiting for the engine at most; past it a client is told to retry (503)
RETRY_AFTER_S = 1


def is_loopback(host: str) -> bool:
    """Whether only this machine reaches `host` (features/api_key.py holds the same rule for the CLI)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bad_ids(ids: object, vocab_size: int, max_model_len: int) -> str | None:
    """Why a request's ids cannot be prefilled (one line), or None: a list of 1..max_model_len - 1 integers in
    0..vocab_size - 1 (one position is the generated token)."""
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        return 'the body must be JSON {"ids": [token ids]}'
    if not ids or len(ids) + 1 > max_model_len:
        return (f"{len(ids)} tokens: the server takes 1..{max_model_len - 1} (--max-model-len {max_model_len}, "
                "one generated token)")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        return f"token id {low if low < 0 else high} is outside the vocabulary (0..{vocab_size - 1})"
    return None


def remove_stale(root: str) -> list[str]:
    """Remove the storage directories of feature servers that are no longer running; the ones removed."""
    removed = []
    for path in glob.glob(os.path.join(root, PREFIX + "*")):
        try:
            with open(os.path.join(path, "pid"), encoding="utf-8") as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pid = 0  # no pid file yet: a server starting right now, or a torn one; age decides
            if time.time() - os.path.getmtime(path) < 600:
                continue
        if pid and process_alive(pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


class Job:
    """One POST /features: the ids in, the file's bytes (or an error) out."""

    def __init__(self, ids: list[int]):
        self.ids, self.done = ids, threading.Event()
        self.data: bytes | None = None
        self.error: str | None = None


class Engine(threading.Thread):
    """The one thread that calls vLLM: gathers queued jobs into a batch, prefills, reads and deletes the files.
    At most `max_queue` jobs wait (`submit` says False past that: the handler answers 503)."""

    def __init__(self, llm: Any, stock: bool, batch_size: int, batch_wait_s: float, max_queue: int = MAX_QUEUE):
        super().__init__(name="eagle3-feature-engine", daemon=True)
        self.llm, self.stock, self.batch_size, self.batch_wait_s = llm, stock, batch_size, batch_wait_s
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max(1, int(max_queue)))
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        self.requests = self.tokens = 0

    def submit(self, job: Job) -> bool:
        """Queue `job`; False when the queue is full (the job is not queued)."""
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    def stop(self) -> None:
        self.jobs.put(None)  # the engine drains what waits, then ends

    def prefill(self, batch: list[Job]) -> Iterator[bytes]:
        """Each job's safetensors bytes, in order: one generate call, each file read and deleted."""
        from vllm.inputs import TokensPrompt

        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=j.ids) for j in batch], prefill_params(),
                                    use_tqdm=False)
        for out in outputs:
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                raise RuntimeError("vLLM returned no hidden_states_path: is the connector configured?")
            wait_written(self.llm, path, self.stock, self.in_process)
            try:
                with open(path, "rb") as f:
                    yield f.read()
            finally:
                os.remove(path)  # used once: the bytes travel, the file goes

    def run(self) -> None:
        stopping = False
        while not stopping:
            job = self.jobs.get()
            if job is None:
                return
            batch = [job]
            deadline = time.monotonic() + self.batch_wait_s
            while len(batch) < self.batch_size:
                try:
                    more = self.jobs.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:
                    stopping = True  # this batch still runs; nothing after it
                    break
                batch.append(more)
            try:
                for j, data in zip(batch, self.prefill(batch)):
                    j.data = data
                    self.requests += 1
                    self.tokens += len(j.ids)
            except Exception as exc:  # every job of the batch gets the one line; the server keeps serving
                message = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                for j in batch:
                    if j.data is None:
                        j.error = f"{type(exc).__name__}: {message}"
                traceback.print_exc()
            finally:
                for j in batch:
                    j.done.set()


def make_handler(identity: dict, engine: Engine, max_model_len: int,
                 api_key: str | None = None) -> type[BaseHTTPRequestHandler]:
    """The request handler: every request authenticated first (with a key), every body checked whole before
    its job is queued."""
    identity_bytes = json.dumps(identity).encode()
    vocab_size = int(identity["vocab_size"])
    key_digest = hashlib.sha256(api_key.encode()).digest() if api_key else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # never log requests (they carry tokens)
            return

        def _send(self, status: int, body: bytes, kind: str = "application/json",
                  headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
            self._send(status, json.dumps({"error": message}).encode(), headers=headers)

        def _authorized(self) -> bool:
            """With a key: the request's bearer token must be it (compared as digests, in constant time)."""
            if key_digest is None:
                return True
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(hashlib.sha256(token.encode()).digest(),
                                                                  key_digest):
                return True
            self.close_connection = True  # a body left unread must not be taken for the next request
            self._error(401, "Unauthorized: send Authorization: Bearer <the server's API key>",
                        {"WWW-Authenticate": "Bearer", "Connection": "close"})
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path == "/identity":
                self._send(200, identity_bytes)
            elif self.path == "/health":
                self._send(200, json.dumps({"ok": True, "requests": engine.requests,
                                            "tokens": engine.tokens}).encode())
            else:
                self._error(404, f"no endpoint {self.path}: GET /identity, GET /health, POST /features")

        def do_POST(self) -> None:
            if not self._authorized():
                return
            if self.path != "/features":
                self.close_connection = True
                self._error(404, f"no endpoint {self.path}: POST /features", {"Connection": "close"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if not 0 < length <= MAX_BODY:
                self.close_connection = True
                self._error(400, f"a request body of {length} bytes (1..{MAX_BODY})", {"Connection": "close"})
                return
            try:
                body = json.loads(self.rfile.read(length))
                ids = body.get("ids") if isinstance(body, dict) else None
            except ValueError:
                ids = None
            why = bad_ids(ids, vocab_size, max_model_len)
            if why is not None:  # answered alone: the job never joins a batch
                self._error(400, why)
                return
            assert isinstance(ids, list)
            job = Job(ids)
            if not engine.submit(job):
                self._error(503, f"busy: {engine.jobs.maxsize} requests are waiting; retry after "
                                 f"{RETRY_AFTER_S} s", {"Retry-After": str(RETRY_AFTER_S)})
                return
            job.done.wait()
            if job.data is None:
                self._error(500, f"vLLM failed: {job.error}")
            else:
                self._send(200, job.data, "application/octet-stream")

    return Handler


def engine_identity(llm: Any, request: dict, kv_config: dict) -> dict:
    """What this server serves, read from vLLM's own model config where it has it."""
    import vllm

    config = llm.llm_engine.model_config.hf_text_config
    return {"verifier": request.get("name") or request["verifier"],
            "verifier_revision": request.get("verifier_revision"),
            "verifier_identity": request.get("verifier_identity") or {},
            "hidden_size": int(config.hidden_size), "num_hidden_layers": int(config.num_hidden_layers),
            "vocab_size": int(config.vocab_size),
            "layer_ids": [int(i) for i in request["layer_ids"]],
            "aux_layer_indices": [int(i) for i in request["aux_layer_indices"]],
            "tokenizer_fingerprint": request.get("tokenizer_fingerprint"), "dtype": request.get("dtype", "auto"),
            "max_model_len": int(request["max_model_len"]), "vllm_version": vllm.__version__,
            "connector": kv_config["kv_connector"], "pid": os.getpid()}


def serve(request: dict) -> None:
    api_key = os.environ.get(API_KEY_ENV, "").strip() or None
    host = request.get("host", "127.0.0.1")
    if api_key is None and not is_loopback(host):  # the launcher refuses first; this is the server's own guard
        raise PermissionError(f"--host {host} without an API key: set {API_KEY_ENV} or listen on 127.0.0.1")
    root = request.get("storage_root") or tempfile.gettempdir()
    for path in remove_stale(root):
        print(f"[feature server] removed {path}, left by a server that is not running", file=sys.stderr)
    storage = tempfile.mkdtemp(prefix=PREFIX, dir=root)
    with open(os.path.join(storage, "pid"), "w", encoding="utf-8") as f:
        f.write(str(os.getpid()))
    httpd: ThreadingHTTPServer | None = None
    try:
        llm, kv_config = load_llm(request, storage, [int(i) for i in request["layer_ids"]])
        stock = kv_config["kv_connector"] == "ExampleHiddenStatesConnector"
        engine = Engine(llm, stock, int(request.get("batch_size", 8)), float(request.get("batch_wait_ms", 5)) / 1e3,
                        int(request.get("max_queue", MAX_QUEUE)))
        engine.start()
        identity = engine_identity(llm, request, kv_config)
        handler = make_handler(identity, engine, int(request["max_model_len"]), api_key)
        httpd = ThreadingHTTPServer((host, int(request.get("port", 0))), handler)
        httpd.daemon_threads = True
        host, port = httpd.server_address[:2]
        url = f"http://{host if isinstance(host, str) else host.decode()}:{port}"
        ready = request.get("ready_file")
        if ready:
            with open(ready + ".tmp", "w", encoding="utf-8") as f:
                json.dump({"url": url, "identity": identity, "storage": storage}, f)
            os.replace(ready + ".tmp", ready)
        server = httpd

        def stop(*_: Any) -> None:
            threading.Thread(target=server.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        parent = Starter(request.get("starter_pid"))
        if request.get("watch_parent", True):
            def watch() -> None:
                while parent.alive():
                    time.sleep(0.5)
                stop()  # the process that started this server has exited: nobody will stop it

            threading.Thread(target=watch, name="eagle3-parent-watch", daemon=True).start()
        httpd.serve_forever(poll_interval=0.2)
        engine.stop()
    finally:
        if httpd is not None:
            httpd.server_close()
        shutil.rmtree(storage, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        request = json.load(f)
    try:
        serve(request)
    except BaseException as exc:  # the launcher reads the error file and reports one line
        error = request.get("error_file")
        if error and not isinstance(exc, KeyboardInterrupt):
            with open(error, "w", encoding="utf-8") as f:
                json.dump(error_result(exc), f)
        if isinstance(exc, KeyboardInterrupt):
            return 0
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
