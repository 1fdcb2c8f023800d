"""The skeleton the in-process HTTP stand-ins share: a ThreadingHTTPServer on 127.0.0.1 (a free port unless told
one), served from a daemon thread between `__enter__` and `__exit__` / `stop()`.

The test Hub (hub_server.py) is not one of them: it runs as a subprocess, stopped by pid."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self  # 3.11+; annotations only


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _send(self, status: int, payload: dict) -> None:
        """`payload` as a JSON answer; a client that hung up first is not an error of the stand-in."""
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except BrokenPipeError:
            pass


class LoopbackServer:
    """Serve `handler` on 127.0.0.1:`port` (0: a free one); `url` is where, `server` the ThreadingHTTPServer."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop accepting: new connections are refused (a killed server); replies in flight still finish."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
