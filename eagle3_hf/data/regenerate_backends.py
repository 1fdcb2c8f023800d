"""The two ways `regenerate` gets an answer to a conversation so far: the verifier in this process
(`TransformersBackend`, batched with left padding, through the project's one generation loop) or an
OpenAI-compatible `/v1/chat/completions` server (`EndpointBackend`: retries with backoff, a request the server
rejects for good raised as `RejectedRequest`, the API key sent and never printed). Kept apart from the loop that
walks the conversations (regenerate.py) so that each side reads alone: here is all that talks to a model.

Both render the prompt with the chat-template kwargs given (`--chat-template-kwargs`, the thinking mode): passed
to `apply_chat_template` in process, sent as the request's `chat_template_kwargs` to a server (vLLM and SGLang
read that key), so the answers are generated in the mode `prepare` will render and the drafter will serve.
"""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from ..errors import EndpointError
from .regenerate_summary import REJECTED_HTTP, RejectedRequest
from .server_wait import DEFAULT_WAIT_S, wait_for_server
from .thinking_mode import split_emitted

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..verifier.generation import FeatureGenerator

# (content, reasoning or None, tool_calls or None, finish_reason, generated tokens)
Completion = tuple[str, "str | None", "list | None", str, int]
_RETRY_HTTP = {408, 409, 425, 429, 500, 502, 503, 504}


class TransformersBackend:
    """The verifier in this process; prompts are batched with left padding."""

    def __init__(self, verifier: str, revision: str | None = None, device: str | None = None, dtype: str = "auto",
                 max_new_tokens: int = 1024, temperature: float = 0.0, top_p: float = 1.0,
                 trust_remote_code: bool | None = None, chat_template_kwargs: dict[str, Any] | None = None):
        import torch

        from eagle3_hf.verifier.loading import load_tokenizer, load_verifier
        from eagle3_hf.verifier.remote_code import set_trusted, trusted

        if trust_remote_code is not None:  # a spawned worker: its parent's --trust-remote-code
            set_trusted(trust_remote_code)
        # what a worker process needs to build the same backend (regenerate --num-workers)
        self.spec: dict[str, Any] = {"verifier": verifier, "revision": revision, "device": device, "dtype": dtype,
                     "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                     "trust_remote_code": trusted(), "chat_template_kwargs": chat_template_kwargs}
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if dtype == "auto":
            dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.name = verifier
        self.tokenizer = load_tokenizer(verifier, revision=revision)
        self.tokenizer.padding_side = "left"
        model = load_verifier(verifier, revision=revision, dtype=getattr(torch, dtype))
        # PreTrainedModel.to is wrapped (functools.wraps), whose stub hides the bound self from mypy
        self.model: PreTrainedModel = model.to(self.device)  # type: ignore[arg-type]
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        if not eos:
            raise ValueError(f"{verifier}: no eos token id in its generation config or tokenizer")
        self.eos = sorted(eos)
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p

    def generator(self, aux_indices: Sequence[int] | None = None) -> FeatureGenerator:
        """The project's one batched generation loop on this verifier; `aux_indices` keeps the features too."""
        from ..verifier.generation import FeatureGenerator

        return FeatureGenerator(self.model, aux_indices, set(self.eos), self.pad, self.max_new_tokens,
                                self.temperature, self.top_p)

    def generate(self, prompts: list[tuple[list[dict], list | None]]) -> list[Completion]:
        """One answer per (messages, tools), through the same loop as `regenerate --features-out`, features off."""
        texts = [cast(str, self.tokenizer.apply_chat_template(m, tools=t, add_generation_prompt=True, tokenize=False,
                                                              **self.chat_template_kwargs)) for m, t in prompts]
        ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        results: list[Completion] = []
        for prompt, r in zip(texts, self.generator().generate(ids, [[] for _ in ids])):
            text = cast(str, self.tokenizer.decode(r.answer, skip_special_tokens=True))  # one sequence: one str
            answer, reasoning = split_emitted(prompt, text)  # as the servers' reasoning parsers return it
            results.append((answer, reasoning, None, r.finish_reason, len(r.answer) + (r.finish_reason == "stop")))
        return results


def chat_completions_url(endpoint: str) -> str:
    """Accept `http://host:port`, `…/v1` or the full `…/v1/chat/completions`."""
    url = endpoint.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class EndpointBackend:
    """An OpenAI-compatible server. The API key is sent as a bearer token and never printed."""

    def __init__(self, endpoint: str, model: str, api_key: str | None = None, max_new_tokens: int = 1024,
                 temperature: float = 0.0, top_p: float = 1.0, timeout: float = 600.0, max_retries: int = 5,
                 retry_backoff: float = 1.0, chat_template_kwargs: dict[str, Any] | None = None):
        self.url, self.name = chat_completions_url(endpoint), model
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        host = urllib.parse.urlparse(self.url).hostname or ""
        # loopback servers are reached directly, whatever proxy the environment names
        handlers = [urllib.request.ProxyHandler({})] if host in ("127.0.0.1", "localhost", "::1") else []
        self._opener = urllib.request.build_opener(*handlers)
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.timeout, self.max_retries, self.retry_backoff = timeout, max_retries, retry_backoff
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def _post(self, payload: dict) -> dict:
        data = json.dumps(payload).encode()
        problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(30.0, self.retry_backoff * 2 ** (attempt - 1)) * (0.5 + random.random() / 2))
            request = urllib.request.Request(self.url, data=data, headers=self._headers, method="POST")
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    body = response.read()
            except urllib.error.HTTPError as e:
                detail = e.read()[:300].decode("utf-8", "replace").strip()
                problem = f"HTTP {e.code}: {detail}"
                if e.code in _RETRY_HTTP:
                    continue
                if e.code in REJECTED_HTTP:  # this sample, for good: skipped by the caller
                    raise RejectedRequest(self.url, e.code, detail) from None
                raise EndpointError(f"{self.url}: {problem}") from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, cut off
                problem = str(getattr(e, "reason", e))
                continue
            try:
                return json.loads(body)
            except json.JSONDecodeError:
                raise EndpointError(f"{self.url}: response is not JSON: {body[:200]!r}") from None
        raise EndpointError(f"{self.url}: gave up after {self.max_retries + 1} attempts; last error: {problem}")

    def wait_for_server(self, seconds: float = DEFAULT_WAIT_S, **kwargs: Any) -> float:
        """Block until the server answers /health or /v1/models (server_wait.py); the seconds waited."""
        return wait_for_server(self._opener, self.url, self._headers, seconds, **kwargs)

    def complete(self, messages: list[dict], tools: list | None = None) -> Completion:
        keep = ("role", "content", "tool_calls", "tool_call_id", "name")
        payload = {"model": self.name, "messages": [{k: m[k] for k in keep if k in m} for m in messages],
                   "max_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}
        if tools:
            payload["tools"] = tools
        if self.chat_template_kwargs:  # the thinking mode, as vLLM and SGLang take it per request
            payload["chat_template_kwargs"] = self.chat_template_kwargs
        reply = self._post(payload)
        try:
            choice = reply["choices"][0]
            msg = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise EndpointError(f"{self.url}: unexpected response without choices[0].message: "
                                f"{json.dumps(reply)[:200]}") from None
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        tokens = (reply.get("usage") or {}).get("completion_tokens") or 0
        return (msg.get("content") or "", reasoning, msg.get("tool_calls"), choice.get("finish_reason") or "?", tokens)
