"""Wait for an OpenAI-compatible server that is still loading, as `regenerate` run after `vllm serve … &` finds it.

A large verifier takes minutes to load (Kimi-K2.5 on one node: tens of minutes), and until then the port is closed
(vLLM) or answers 503 (SGLang before its warm-up). The request retries of `regenerate` last about half a minute,
so without this wait the README's two lines would give up before the model is up. Ready means: `GET /health` 200
(vLLM, SGLang); or, where the server has no such route (404/405, or it is behind the API key), `GET /v1/models`
answers 200 (or 401/403: it is up, the key problem is then the first request's one-line error). A 5xx from
/health means loading: keep waiting. Bounded by `--wait-for-server` seconds; a progress line every 30 s.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from ..errors import EndpointError

DEFAULT_WAIT_S = 1800.0  # a trillion-parameter verifier loading on one node fits in half an hour
_UP = {200}
_UP_BEHIND_KEY = {200, 401, 403}


def server_roots(chat_url: str) -> tuple[str | None, str]:
    """(the /health URL or None, the /models URL) of a `…/chat/completions` URL."""
    root = chat_url[: -len("/chat/completions")] if chat_url.endswith("/chat/completions") else chat_url
    health = root[: -len("/v1")] + "/health" if root.endswith("/v1") else None
    return health, root + "/models"


def _status(opener: urllib.request.OpenerDirector, url: str, headers: dict[str, str], timeout: float) -> str | int:
    """The HTTP status of GET url, or the reason no answer came (a string)."""
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))


def server_ready(opener: urllib.request.OpenerDirector, chat_url: str, headers: dict[str, str],
                 timeout: float = 10.0) -> tuple[bool, str]:
    """(ready, what was seen) by one look at /health, then /v1/models."""
    health, models = server_roots(chat_url)
    seen = ""
    if health is not None:
        code = _status(opener, health, headers, timeout)
        if code in _UP:
            return True, f"{health}: 200"
        if isinstance(code, int) and code >= 500:
            return False, f"{health}: HTTP {code} (loading)"
        seen = f"{health}: {code if isinstance(code, str) else f'HTTP {code}'}"
        if isinstance(code, str):  # nothing listens yet
            return False, seen
    code = _status(opener, models, headers, timeout)
    if code in _UP_BEHIND_KEY:
        return True, f"{models}: HTTP {code}"
    return False, f"{models}: {code if isinstance(code, str) else f'HTTP {code}'}"


def wait_for_server(opener: urllib.request.OpenerDirector, chat_url: str, headers: dict[str, str],
                    seconds: float = DEFAULT_WAIT_S, interval: float = 2.0, progress_every: float = 30.0,
                    log: Callable[[str], None] | None = None) -> float:
    """Block until the server is ready; the seconds waited. `seconds` <= 0: no wait. Raises EndpointError (one
    line, the last thing seen) when it is not ready within `seconds`."""
    if seconds <= 0:
        return 0.0
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.monotonic()
    next_report = start + progress_every
    while True:
        ready, seen = server_ready(opener, chat_url, headers)
        now = time.monotonic()
        if ready:
            if now - start >= 1.0:
                log(f"regenerate: the server is up after {now - start:.0f} s")
            return now - start
        if now - start >= seconds:
            raise EndpointError(f"{chat_url}: no server ready within {seconds:.0f} s (--wait-for-server); last seen "
                                f"{seen}; is it running, on this host and port?")
        if now >= next_report:
            log(f"regenerate: waiting for the server ({now - start:.0f} s of {seconds:.0f} s; {seen})")
            next_report = now + progress_every
        time.sleep(min(interval, max(0.0, start + seconds - now)))
