"""`llama-server` as `evaluate --engine llamacpp` runs it: one slot, on 127.0.0.1, plain or with an EAGLE-3 drafter
(`--spec-type draft-eagle3`), and a client that decodes one prompt of token ids and reads back what the engine did.

The server reports its draft counters per request (`timings.draft_n`, `timings.draft_n_accepted`) and, with
`timings_per_token`, on every streamed token. A verify cycle adds its drafts and its accepted drafts to both
before it emits its tokens (tools/server/server-context.cpp: `n_draft_tokens` when drafting, `n_draft_accepted`
before `process_token`), so the stream splits into cycles exactly: a token whose counters moved opens a cycle that
emits `accepted + 1` tokens; a token whose counters did not move is a cycle without a draft. The first token is
the prefill's. `steps_from_stream` does that split; `LlamaServer.complete` returns it with the tokens, their top-2
log-probability margins (greedy ties) and the server's own timings.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .llamacpp_env import LlamaCpp
from .server_process import ServerProcess


@dataclass
class Completion:
    """One prompt decoded by llama-server."""

    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 log-probability per token (inf where not reported)
    drafted: list[int]  # per verify cycle after the prefill: drafts offered (0: a cycle without a draft)
    accepted: list[int]  # per verify cycle: drafts accepted
    seconds: float  # the server's own generation time (timings.predicted_ms), prefill excluded
    prompt_seconds: float
    draft_n: int = 0  # the server's counters for the request (timings.draft_n, draft_n_accepted)
    draft_n_accepted: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def steps_from_stream(counters: Iterable[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """(drafted, accepted) per verify cycle from each streamed token's cumulative (draft_n, draft_n_accepted);
    the first token is the prefill's (module docstring)."""
    drafted: list[int] = []
    accepted: list[int] = []
    previous, owed = (0, 0), 0
    for i, (n, a) in enumerate(counters):
        if i == 0:
            previous = (n, a)
            continue
        if owed:
            owed -= 1
            continue
        drafted.append(n - previous[0])
        accepted.append(a - previous[1])
        owed = a - previous[1]
        previous = (n, a)
    return drafted, accepted


def _margin(probs: list[dict[str, Any]] | None) -> float:
    tops = sorted((float(p["logprob"]) for p in (probs or []) if p.get("logprob") is not None), reverse=True)
    return tops[0] - tops[1] if len(tops) >= 2 else float("inf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer(ServerProcess):
    """llama-server on one GGUF (the verifier), with the drafter when `draft` is given."""

    kill_group_after_exit = True

    def __init__(self, build: LlamaCpp, model: Path, log_path: Path, *, draft: Path | None = None, k: int = 3,
                 p_min: float = 0.0, threads: int = 1, ctx_size: int = 2048, timeout: float = 600.0,
                 debug: bool = False, spec_type: str = "draft-eagle3"):
        super().__init__(timeout, debug)
        self.build, self.model, self.draft, self.k, self.p_min = build, model, draft, k, p_min
        self.spec_type = spec_type  # draft-eagle3, or draft-dflash for a DFlash drafter
        self.threads, self.ctx_size, self.port = threads, ctx_size, free_port()
        self._log_path = log_path

    def argv(self) -> list[str]:
        argv = [str(self.build.server), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                "--threads", str(self.threads), "--threads-batch", str(self.threads), "--ctx-size",
                str(self.ctx_size), "--parallel", "1", "--no-webui"]
        if self.draft is not None:
            argv += ["--spec-draft-model", str(self.draft), "--spec-type", self.spec_type, "--spec-draft-n-max",
                     str(self.k), "--spec-draft-p-min", f"{self.p_min:g}", "--spec-draft-threads", str(self.threads),
                     "--spec-draft-threads-batch", str(self.threads)]
        return argv

    def _start(self) -> None:
        import os

        assert self._log_path is not None
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        self._launch(self.argv(), dict(os.environ))

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
            return False

    def _exit_error(self, status: int) -> Exception:
        what = "with the drafter " + str(self.draft) if self.draft else "plain"
        return UsageError(f"llama-server ({what}) exited before it served: {self._last_line(self._log_text(), status)} "
                          f"(log: {self._log_path})")

    def _timeout_error(self) -> Exception:
        return UsageError(f"llama-server did not serve within {self.timeout:.0f} s (log: {self._log_path})")

    def complete(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 probs: bool = True, ignore_eos: bool = False) -> Completion:
        """Decode `ids` (the rendered prompt); streamed, so that the cycles can be told apart. `ignore_eos`: always
        `max_new_tokens` (a bench's fixed length)."""
        body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": temperature, "seed": seed,
                "stream": True, "timings_per_token": True, "return_tokens": True, "cache_prompt": False,
                "n_probs": 2 if probs else 0, "ignore_eos": ignore_eos}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise UsageError(f"llama-server answered {response.status}: {response.read()[:300]!r}")
            chunks = [json.loads(line[5:]) for line in (raw.decode("utf-8").strip() for raw in response)
                      if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]")]
        finally:
            conn.close()
        tokens, margins, counters = [], [], []
        final: dict[str, Any] = {}
        for chunk in chunks:
            if chunk.get("stop"):
                final = chunk
                continue
            timings = chunk.get("timings") or {}
            for j, token in enumerate(chunk.get("tokens") or []):
                tokens.append(int(token))
                found = chunk.get("completion_probabilities") or []
                margins.append(_margin(found[j].get("top_logprobs") if j < len(found) else None))
                counters.append((int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))))
        drafted, accepted = steps_from_stream(counters)
        timings = final.get("timings") or {}
        return Completion(tokens=tokens, margins=margins, drafted=drafted, accepted=accepted,
                          seconds=float(timings.get("predicted_ms", 0.0)) / 1000.0,
                          prompt_seconds=float(timings.get("prompt_ms", 0.0)) / 1000.0,
                          draft_n=int(timings.get("draft_n", 0)),
                          draft_n_accepted=int(timings.get("draft_n_accepted", 0)))
