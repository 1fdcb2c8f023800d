"""A small OpenAI-compatible `/v1/chat/completions` server for tests, on 127.0.0.1 and a free port.

Replies are a deterministic function of the request (`reply_for`), so a test can recompute what a
correct regeneration must contain. Knobs: a delay per request (to observe concurrency), a number of
initial 503s (to exercise retries), predicates that reject requests with 400 or fail them with 500, a required
API key, request numbers whose connection drops halfway through the reply body, and a fixed port (to restart a
killed server).
A thinking model's server: `reasoning_for(messages)` gives the reasoning its parser returns (under `reasoning_key`,
`reasoning_content` or vLLM's newer `reasoning`), `cut(messages)` answers finish_reason "length". A server still
loading: `loading_s` seconds of 503 from /health and the chat route after it starts (`late_server` starts one
only after a delay: nothing listens before), and at least `loading_checks` answers of 503 from /health whenever the
client first looks (a client slow to start on a loaded machine still sees the server loading).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from tests.helpers.loopback import LoopbackServer, QuietHandler


def reply_for(messages: list[dict]) -> str:
    last = messages[-1]["content"]
    return f"[{len(messages)}] re: {last[:24]}"


class OpenAIStub(LoopbackServer):
    def __init__(self, delay: float = 0.0, fail_first: int = 0, reject: Callable[[list[dict]], bool] | None = None,
                 api_key: str | None = None, model: str = "stub-model", drop: set[int] = frozenset(), port: int = 0,
                 reasoning_for: Callable[[list[dict]], str | None] | None = None,
                 reasoning_key: str = "reasoning_content", cut: Callable[[list[dict]], bool] | None = None,
                 loading_s: float = 0.0, crash: Callable[[list[dict]], bool] | None = None, loading_checks: int = 0):
        self.delay, self.fail_first, self.reject, self.api_key, self.model = delay, fail_first, reject, api_key, model
        self.reasoning_for, self.reasoning_key, self.cut, self.crash = reasoning_for, reasoning_key, cut, crash
        self.ready_at = time.monotonic() + loading_s
        self.loading_checks = loading_checks
        self.gets: list[str] = []
        self.drop = set(drop)
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        stub = self

        class Handler(QuietHandler):
            def _send(self, code: int, payload: dict, drop: bool = False) -> None:
                body = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if drop:  # the server dies mid-reply: half the body, then the connection closes
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def do_GET(self):
                stub.gets.append(self.path)
                if self.path == "/health":
                    with stub.lock:
                        loading = time.monotonic() < stub.ready_at or stub.loading_checks > 0
                        stub.loading_checks = max(0, stub.loading_checks - 1)
                    self._send(503 if loading else 200, {})
                elif self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if time.monotonic() < stub.ready_at:
                    return self._send(503, {"error": {"message": "loading"}})
                if stub.api_key is not None and self.headers.get("Authorization") != f"Bearer {stub.api_key}":
                    return self._send(401, {"error": {"message": "bad api key"}})
                with stub.lock:
                    stub.requests.append(payload)
                    n = len(stub.requests)
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    time.sleep(stub.delay)
                    if n <= stub.fail_first:
                        return self._send(503, {"error": {"message": "overloaded"}})
                    messages = payload["messages"]
                    if stub.crash is not None and stub.crash(messages):
                        return self._send(500, {"error": {"message": "engine error"}})
                    if stub.reject is not None and stub.reject(messages):
                        return self._send(400, {"error": {"message": "rejected by test"}})
                    content = reply_for(messages)
                    message = {"role": "assistant", "content": content}
                    if stub.reasoning_for is not None and (thought := stub.reasoning_for(messages)):
                        message[stub.reasoning_key] = thought
                    finish = "length" if stub.cut is not None and stub.cut(messages) else "stop"
                    self._send(200, drop=n in stub.drop, payload={
                        "id": f"chatcmpl-{n}", "object": "chat.completion", "model": payload["model"],
                        "choices": [{"index": 0, "finish_reason": finish, "message": message}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": len(content.split()),
                                  "total_tokens": 1 + len(content.split())},
                    })
                finally:
                    with stub.lock:
                        stub.in_flight -= 1

        super().__init__(Handler, port)


@contextmanager
def late_server(port: int, delay: float, **kwargs) -> Iterator[dict]:
    """An OpenAIStub on `port` that starts listening only `delay` seconds from now (`kwargs` as OpenAIStub's);
    yields a dict whose "stub" is the server once started."""
    holder: dict = {}

    def start() -> None:
        holder["stub"] = OpenAIStub(port=port, **kwargs).__enter__()

    timer = threading.Timer(delay, start)
    timer.start()
    try:
        yield holder
    finally:
        timer.cancel()
        timer.join()
        if "stub" in holder:
            holder["stub"].stop()
