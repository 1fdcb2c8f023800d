"""A feature server: vLLM loaded once with extract_hidden_states, answering HTTP requests on one address.

Runs inside the vLLM venv, executed by path (standard library, torch, safetensors and vllm; never eagle3_hf),
with vllm_extract_runner.py beside it supplying the engine (`load_llm`: the same LLM, connector and prefill
settings as `extract --engine vllm`) and `wait_written`. Started by `eagle3-hf serve-features`
(engines/vllm_feature_launcher.py `VllmFeatureServer`); a trainer with `--features URL` is its client
(features/feature_server.py).

    python vllm_feature_server.py REQUEST.json

Endpoints:
  GET  /identity   JSON: what is served (verifier, hidden_size, num_hidden_layers, layer_ids,
                   aux_layer_indices, tokenizer_fingerprint, dtype, max_model_len, vllm_version, connector)
  GET  /health     JSON: {"ok": true, "requests": n, "tokens": n}
  POST /features   body JSON {"ids": [token ids]} -> 200, application/octet-stream: the safetensors file
                   vLLM's connector wrote ({hidden_states [T, len(layer_ids), hidden], token_ids [T]}), deleted
                   here once read; 400 {"error"} for a bad request, 500 {"error"} when vLLM failed.

Requests that arrive together are prefilled in one `generate` call (at most `batch_size`, gathered for
`batch_wait_ms`); one engine thread owns vLLM. Files live in this server's own temporary directory
(PREFIX + random, with its pid): each is deleted as soon as it is read, the directory at exit, and a start
removes the directories of servers that died without cleaning up (SIGKILL). The server stops when the
process that started it exits (`watch_parent`), on SIGTERM or SIGINT. Token ids are never logged.
"""

from __future__ import annotations

import glob
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from vllm_extract_runner import load_llm, prefill_params, process_alive, wait_written  # noqa: E402  (this directory, above)
from vllm_runner import error_result  # noqa: E402

PREFIX = "eagle3_feature_server_"
MAX_BODY = 64 << 20  # a request is token ids as JSON: 64 MiB is millions of tokens


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
    """The one thread that calls vLLM: gathers queued jobs into a batch, prefills, reads and deletes the files."""

    def __init__(self, llm: Any, stock: bool, batch_size: int, batch_wait_s: float):
        super().__init__(name="eagle3-feature-engine", daemon=True)
        self.llm, self.stock, self.batch_size, self.batch_wait_s = llm, stock, batch_size, batch_wait_s
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        self.params = prefill_params()
        self.requests = self.tokens = 0

    def run(self) -> None:
        from vllm.inputs import TokensPrompt

        while True:
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
                    self.jobs.put(None)
                    break
                batch.append(more)
            try:
                outputs = self.llm.generate([TokensPrompt(prompt_token_ids=j.ids) for j in batch], self.params,
                                            use_tqdm=False)
                for j, out in zip(batch, outputs):
                    path = (out.kv_transfer_params or {}).get("hidden_states_path")
                    if not path:
                        raise RuntimeError("vLLM returned no hidden_states_path: is the connector configured?")
                    wait_written(self.llm, path, self.stock, self.in_process)
                    try:
                        with open(path, "rb") as f:
                            j.data = f.read()
                    finally:
                        os.remove(path)  # used once: the bytes travel, the file goes
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


def make_handler(identity: dict, engine: Engine, max_model_len: int) -> type[BaseHTTPRequestHandler]:
    identity_bytes = json.dumps(identity).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # never log requests (they carry tokens)
            return

        def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, status: int, message: str) -> None:
            self._send(status, json.dumps({"error": message}).encode())

        def do_GET(self) -> None:
            if self.path == "/identity":
                self._send(200, identity_bytes)
            elif self.path == "/health":
                self._send(200, json.dumps({"ok": True, "requests": engine.requests,
                                            "tokens": engine.tokens}).encode())
            else:
                self._error(404, f"no endpoint {self.path}: GET /identity, GET /health, POST /features")

        def do_POST(self) -> None:
            if self.path != "/features":
                self._error(404, f"no endpoint {self.path}: POST /features")
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY:
                self._error(400, f"a request body of {length} bytes (1..{MAX_BODY})")
                return
            try:
                ids = json.loads(self.rfile.read(length))["ids"]
                ids = [int(t) for t in ids]
            except (ValueError, KeyError, TypeError):
                self._error(400, 'the body must be JSON {"ids": [token ids]}')
                return
            if not ids or len(ids) + 1 > max_model_len:
                self._error(400, f"{len(ids)} tokens: the server takes 1..{max_model_len - 1} "
                                 f"(--max-model-len {max_model_len}, one generated token)")
                return
            job = Job(ids)
            engine.jobs.put(job)
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
            "hidden_size": int(config.hidden_size), "num_hidden_layers": int(config.num_hidden_layers),
            "layer_ids": [int(i) for i in request["layer_ids"]],
            "aux_layer_indices": [int(i) for i in request["aux_layer_indices"]],
            "tokenizer_fingerprint": request.get("tokenizer_fingerprint"), "dtype": request.get("dtype", "auto"),
            "max_model_len": int(request["max_model_len"]), "vllm_version": vllm.__version__,
            "connector": kv_config["kv_connector"], "pid": os.getpid()}


def serve(request: dict) -> None:
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
        engine = Engine(llm, stock, int(request.get("batch_size", 8)), float(request.get("batch_wait_ms", 5)) / 1e3)
        engine.start()
        identity = engine_identity(llm, request, kv_config)
        handler = make_handler(identity, engine, int(request["max_model_len"]))
        httpd = ThreadingHTTPServer((request.get("host", "127.0.0.1"), int(request.get("port", 0))), handler)
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
        parent = os.getppid()
        if request.get("watch_parent", True):
            def watch() -> None:
                while os.getppid() == parent:
                    time.sleep(0.5)
                stop()  # the process that started this server has exited: nobody will stop it

            threading.Thread(target=watch, name="eagle3-parent-watch", daemon=True).start()
        httpd.serve_forever(poll_interval=0.2)
        engine.jobs.put(None)
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
