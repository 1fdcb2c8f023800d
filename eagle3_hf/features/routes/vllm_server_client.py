"""`extract --engine vllm --endpoint URL`: the features of a prepared dataset from a running vLLM OpenAI server.

The server is vLLM's own API server started with the extraction config (`eagle3-hf serve-vllm`,
engines/vllm/vllm_openai.py). Each sample is one completion request (its token ids as the prompt, max_tokens=1,
greedy, `return_token_ids`); vLLM answers with `kv_transfer_params.hidden_states_path`, the file its
hidden-states connector writes. This client waits on the file's `.lock` (LOCK_SH: vLLM's worker holds
LOCK_EX until the file is whole), hands the path to the same reader as the offline route
(vllm_spec.VllmFeatureSpec.features: checked, mapped, into a shard, deleted) and removes the lock. The
client must see the server's storage: run it on the server's machine, or share that directory.

What is checked against the server before anything is written: it serves the verifier given by
`--verifier` (its `root`) and its answers carry a hidden-states path (a plain server does not); a sample its
`max_model_len` cannot take is skipped and counted (write.py). On every sample the server's own next token must
agree with the verifier's greedy token computed here from the last captured state; if the first samples all disagree,
the server's layer ids are not the ones asked for (or its final norm differs), and the run stops.

Requests run `concurrency` at a time (the server batches them), in order; each has a timeout, 5xx answers
and dropped connections are retried, and a file whose request this client abandoned is deleted. Every request
carries $EAGLE3_HF_API_KEY as a bearer token when it is set (`serve-vllm` gives vLLM the same key); a 401 is one
line saying whether a key was sent.

What this client trusts of an answer (docs/security.md): nothing it has not checked. It reads and deletes only
files inside the server's storage directory (`--vllm-storage`, else the one `serve-vllm` names in /v1/models,
else the first answer's directory, said on stderr) and named as vLLM's connector names this request's file
(`cmpl-<the request id this client sent>-0-<suffix>.safetensors`, so no file that existed before the request
can match); symlinks are resolved first. Any other path is refused in one line, untouched. An answer is at
most ANSWER_LIMIT bytes and must arrive whole within the timeout.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ...errors import EndpointError
from ..api_key import api_key, auth_headers, refused_line
from ..table import SourceRequest
from ..vllm.vllm_features import VllmFeatures
from ..vllm.vllm_spec import VllmFeatureSpec, VllmOptions
from ..write import sample_token_limit

ENDPOINT_TIMEOUT_S = 600.0  # one completion (and its file) from a running server; --vllm-timeout overrides


def remove_file(path: str) -> None:
    """Delete a file vLLM wrote and its lock: only ever called with a path `StoragePolicy.vet` accepted."""
    for p in (path, path + ".lock"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


REFUSED = "refused (nothing read or removed)"


class StoragePolicy:
    """Which paths an answer may name: files of the connector's pattern for this request, in one directory.

    `storage` is the directory (`--vllm-storage`, or what the server names); None takes the first vetted
    answer's directory. Paths are compared after resolving symlinks, so a link inside the directory that
    points out of it, or a `..`, is outside. Thread-safe: answers arrive on the pool's threads."""

    def __init__(self, url: str, storage: str | None):
        self.url = url
        self.storage = os.path.realpath(storage) if storage else None
        self._lock = threading.Lock()

    @staticmethod
    def pattern(request_id: str) -> re.Pattern[str]:
        """The name vLLM's hidden-states connector gives a completion's file: `<engine request id>.safetensors`,
        the engine id being `cmpl-<X-Request-Id>-<prompt index>` plus vLLM's random suffix."""
        return re.compile(rf"cmpl-{re.escape(request_id)}-0(?:-[0-9A-Za-z]{{1,64}})?\.safetensors")

    def vet(self, path: object, request_id: str) -> str:
        """The resolved path of the file to read, or EndpointError (one line) without touching anything."""
        where = f"{self.url} answered hidden_states_path {path!r}"
        if not isinstance(path, str) or not os.path.isabs(path):
            raise EndpointError(f"{where}, not an absolute path: {REFUSED}")
        if ".." in path.split(os.sep):
            raise EndpointError(f"{where}, which has a '..' component: {REFUSED}")
        if not self.pattern(request_id).fullmatch(os.path.basename(path)):
            raise EndpointError(f"{where}, not the name vLLM's connector gives this request's file "
                                f"(cmpl-<request id>-0-<suffix>.safetensors): {REFUSED}")
        with self._lock:
            if self.storage is None:
                folder = os.path.dirname(path)
                if not os.path.isdir(folder):
                    raise EndpointError(f"{self.url} writes its states to {folder}, which this machine cannot see: "
                                        "run the client on the server's machine or share that directory at the "
                                        "same path")
                self.storage = os.path.realpath(folder)
                print(f"[extract] {self.url} does not name its storage directory: reading and deleting only its "
                      f"files in {self.storage} (--vllm-storage sets it)", file=sys.stderr)
        storage = self.storage
        for name, which in ((path, "which"), (path + ".lock", "whose .lock")):
            real = os.path.realpath(name)
            if os.path.dirname(real) != storage or os.path.basename(real) != os.path.basename(name):
                shown = "" if real == name else f", {which} resolves to {real}"
                raise EndpointError(f"{where}{shown}, outside its storage {storage}: {REFUSED}")
        return os.path.join(storage, os.path.basename(path))

    def check_still_inside(self, path: str) -> None:
        """Just before the file is read: it must not have become a link since it was vetted."""
        for name in (path, path + ".lock"):
            if os.path.islink(name):
                raise EndpointError(f"{name} became a symlink (to {os.path.realpath(name)}) after {self.url} "
                                    f"answered: {REFUSED}")


class WriteFailed(OSError):
    """vLLM released a file's lock without writing the file (its save raised: a full disk, a permission)."""


def wait_for_lock(path: str, deadline: float) -> None:
    """Until vLLM's worker has released the file's lock (the file is whole), polling so that a dead or hung
    server ends at the deadline instead of blocking forever (TimeoutError). The lock file is removed once held;
    WriteFailed when the lock was released and no file is there."""
    lock = path + ".lock"
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)  # a lock that became a link is not followed
        except FileNotFoundError:
            if os.path.exists(path):
                return  # no lock (use_synchronization_lock off) and the file is there
            fd = -1
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise EndpointError(f"{lock} became a symlink (to {os.path.realpath(lock)}): {REFUSED}") from None
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
            else:
                os.close(fd)
                os.unlink(lock)
                if not os.path.exists(path):  # the writer let go without writing: its save failed
                    raise WriteFailed(path)
                return
        if time.monotonic() > deadline:
            raise TimeoutError(path)
        time.sleep(0.01)


RETRY_BACKOFF_S = 1.0  # the first wait before retrying a failed completion; each next one doubles


class EndpointExtraction:
    """The records of `VllmExtraction` (engines/vllm/vllm_env.py), from a running server: {"key", "path",
    "next_token"} per prompt, in submission order. Use as a context manager: leaving deletes the files of
    requests not yet taken (an error, a Ctrl-C).

    `result` has VllmExtraction's keys: "vllm_version" (from the answers' system_fingerprint, None when it
    names none) and "connector", always None here (the server chose its connector; its answers do not say which)."""

    def __init__(self, url: str, prompts: Iterable[tuple[int, list[int]]], model: str, concurrency: int = 8,
                 timeout: float = 600.0, retries: int = 3, backoff_s: float | None = None, storage: str | None = None):
        self.url, self.model = url.rstrip("/"), model
        self.api_key = api_key()
        self.prompts, self.concurrency = prompts, max(1, int(concurrency))
        self.timeout, self.retries = float(timeout), int(retries)
        self.backoff_s = RETRY_BACKOFF_S if backoff_s is None else float(backoff_s)
        self.policy = StoragePolicy(self.url, storage)
        self.peak_pending_bytes = 0
        self.result: dict[str, Any] = {"connector": None, "vllm_version": None}
        self._futures: deque[Future[dict[str, Any]]] = deque()
        self._pool: ThreadPoolExecutor | None = None

    def __enter__(self) -> EndpointExtraction:
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="eagle3-endpoint")
        return self

    def _post(self, ids: list[int], request_id: str) -> dict[str, Any]:
        from ...engines.vllm.vllm_openai import read_answer

        body = json.dumps({"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                           "return_token_ids": True}).encode()
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json",
                                                      "X-Request-Id": request_id, **auth_headers(self.api_key)})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    answer = read_answer(response, self.url, time.monotonic() + self.timeout)
                if not isinstance(answer, dict):
                    raise EndpointError(f"{self.url} answered a completion that is not a JSON object")
                return answer
            except urllib.error.HTTPError as exc:
                if exc.code < 500 or attempt == self.retries:
                    raise EndpointError(self._why(exc)) from None
            except (urllib.error.URLError, ConnectionError) as exc:
                if attempt == self.retries:
                    raise EndpointError(self._why(exc)) from None
            except TimeoutError:
                raise EndpointError(f"{self.url} did not answer a completion within {self.timeout:.0f} s "
                                    "(--vllm-timeout sets the limit)") from None
            except ValueError as exc:
                raise EndpointError(str(exc)) from None
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _why(self, exc: Exception) -> str:
        return server_error_line(self.url, exc, self.api_key)

    def _one(self, key: int, ids: list[int]) -> dict[str, Any]:
        request_id = f"eagle3-{uuid.uuid4().hex}"  # the connector names the file for it: no older file can match
        answer = self._post(ids, request_id)
        params = answer.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path") if isinstance(params, dict) else None
        if not path:
            raise EndpointError(f"{self.url} answered without kv_transfer_params.hidden_states_path: it was not "
                                "started with the extraction config (`eagle3-hf serve-vllm`)")
        path = self.policy.vet(path, request_id)
        choices = answer.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        usage = answer.get("usage")
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if prompt_tokens is not None and prompt_tokens != len(ids):
            remove_file(path)
            raise EndpointError(f"{self.url} prefilled {prompt_tokens!r} tokens for a prompt of {len(ids)}")
        try:
            wait_for_lock(path, time.monotonic() + self.timeout)
        except WriteFailed:
            raise EndpointError(f"vLLM at {self.url} released {path}.lock without writing {path}: its write failed "
                                "(is its storage disk full? the server's log says why)") from None
        except TimeoutError:
            remove_file(path)
            raise EndpointError(f"vLLM at {self.url} did not finish writing {path} within {self.timeout:.0f} s "
                                "(--vllm-timeout sets the limit)") from None
        if self.result["vllm_version"] is None:
            fingerprint = str(answer.get("system_fingerprint") or "")
            self.result["vllm_version"] = fingerprint.split("-")[1] if fingerprint.startswith("vllm-") else None
        tokens = choice.get("token_ids")
        if tokens and not (isinstance(tokens, list) and isinstance(tokens[0], int)):
            remove_file(path)
            raise EndpointError(f"{self.url} answered token_ids {str(tokens)[:80]}, not a list of token ids")
        return {"key": key, "path": path, "prompt_tokens": len(ids), "next_token": int(tokens[0]) if tokens else None}

    def records(self) -> Iterator[dict[str, Any]]:
        assert self._pool is not None, "use EndpointExtraction as a context manager"
        prompts = iter(self.prompts)
        exhausted = False
        while True:
            while not exhausted and len(self._futures) < 2 * self.concurrency:
                try:
                    key, ids = next(prompts)
                except StopIteration:
                    exhausted = True
                    break
                self._futures.append(self._pool.submit(self._one, key, ids))
            if not self._futures:
                return
            record = self._futures[0].result()
            self._futures.popleft()
            self.policy.check_still_inside(record["path"])
            self.peak_pending_bytes = max(self.peak_pending_bytes, self._pending_bytes(record["path"]))
            yield record

    def _pending_bytes(self, path: str) -> int:
        """The bytes lying in the server's storage now (what this client has not yet taken and deleted)."""
        total = 0
        for entry in os.scandir(os.path.dirname(path) or "."):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def __exit__(self, *exc: object) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for future in self._futures:
            future.cancel()
        pool.shutdown(wait=True)
        for future in self._futures:  # answered but never taken: their files would lie in the server's storage
            if future.done() and not future.cancelled() and future.exception() is None:
                remove_file(future.result()["path"])
        self._futures.clear()


def check_server(url: str, verifier: str, verifier_path: str, layer_ids: list[int],
                 storage: str | None = None) -> dict[str, Any]:
    """The model the server at `url` serves, checked against `--verifier` and the layer ids; one line
    (EndpointError) when it is missing, serves another model or captures other layers (as its second
    served-model name says). Its "max_model_len" bounds the samples extracted (longer ones are skipped and
    counted: write.py). Its "storage" is the directory whose files the client
    may read and delete: `storage` (--vllm-storage), which the server's own must not contradict, else the one
    it names (it must be visible here), else None (the first answer's, StoragePolicy)."""
    from ...engines.vllm.vllm_openai import served_layer_ids, served_storage, server_models

    key = api_key()
    try:
        models = server_models(url, timeout=30.0, api_key=key)
    except TimeoutError:
        raise EndpointError(f"{url}/v1/models did not answer within 30 s") from None
    except ValueError as exc:
        raise EndpointError(str(exc)) from None
    except (urllib.error.URLError, OSError) as exc:
        raise EndpointError(server_error_line(url, exc, key)) from None
    if not models:
        raise EndpointError(f"{url}/v1/models lists no model")
    model = models[0]
    served = {str(model.get("root") or ""), str(model.get("id") or "")}
    wanted = {str(verifier), str(verifier_path), os.path.realpath(verifier_path)}
    if not served & wanted and not any(os.path.exists(s) and os.path.realpath(s) in wanted for s in served):
        raise EndpointError(f"{url} serves {model.get('root') or model.get('id')}, not the verifier {verifier} "
                            "(--verifier)")
    captured = served_layer_ids(models)
    if captured is None:
        print(f"[extract] {url} does not name the layer ids it captures (a server not started by `eagle3-hf "
              f"serve-vllm`): only its last id is checked, by its next tokens; its aux ids must be "
              f"{list(layer_ids)[:-1]}",
              file=sys.stderr)
    elif captured != list(layer_ids):
        raise EndpointError(f"{url} captures vLLM layer ids {captured}; this extraction needs {list(layer_ids)} "
                            "(--aux-layers must be the server's)")
    model["storage"] = storage_directory(url, storage, served_storage(models))
    return model


def server_error_line(url: str, exc: Exception, key: str | None) -> str:
    """Why a request failed, one line; a 401 says whether a key was sent (never the key)."""
    from ...engines.vllm.vllm_openai import server_error

    if isinstance(exc, urllib.error.HTTPError) and exc.code == 401:
        return refused_line(url, key)
    return server_error(url, exc)


def storage_directory(url: str, given: str | None, named: str | None) -> str | None:
    """The storage directory the client keeps to: `given` (--vllm-storage) or the server's `named` one; one line
    when it is not a directory here or when the two differ."""
    if given and named and os.path.realpath(given) != os.path.realpath(named):
        raise EndpointError(f"{url} writes its states to {named}, not --vllm-storage {given}")
    folder = given or named
    if folder and not os.path.isdir(folder):
        raise EndpointError(f"{url} writes its states to {folder}, which this machine cannot see: run the client "
                            "on the server's machine or share that directory at the same path")
    return folder



# ---------------------------------------------------------------- the route

class VllmServerFeatures(VllmFeatures):
    """A running vLLM OpenAI server as a `FeatureSource` (the vllm-server row): the server checked first (it
    serves `verifier`, captures the layers asked for, names its storage), then `batch_size` requests in flight,
    each sample's file read here as the offline route reads its own engine's."""

    served: dict[str, Any] | None = None

    def check(self, lengths: Sequence[int]) -> int | None:
        """The most tokens a sample may have: --max-model-len's or the server's context, whichever is shorter, less
        the generated token (write.sample_token_limit)."""
        options, limit = self.options, sample_token_limit(self.options.max_model_len)
        # the only directory whose files a server may name (StoragePolicy)
        self.served = check_server(str(options.endpoint), self.verifier, self.spec.path, self.spec.layer_ids,
                                   options.storage)
        served = sample_token_limit(self.served.get("max_model_len"))
        return served if served is not None and (limit is None or served < limit) else limit

    def open_run(self, request: dict[str, Any], prompts: Iterator[tuple[int, list[int]]]) -> EndpointExtraction:
        if self.served is None:
            raise RuntimeError("check() names the server before states() asks it")
        options = self.options
        return EndpointExtraction(str(options.endpoint), prompts, model=str(self.served["id"]),
                                  concurrency=options.batch_size,
                                  timeout=ENDPOINT_TIMEOUT_S if options.timeout is None else options.timeout,
                                  storage=self.served["storage"])


def open_source(request: SourceRequest) -> VllmServerFeatures:
    """The table's opener (table.py) of `--engine vllm --endpoint URL`: `request.options` a `VllmOptions` naming the
    server (`endpoint`) and, where the default is not it, its storage directory. No vLLM is needed here."""
    options = request.options if isinstance(request.options, VllmOptions) else VllmOptions()
    if options.endpoint is None:
        raise EndpointError("the vllm-server route needs the server's URL (VllmOptions.endpoint; --endpoint URL)")
    spec = VllmFeatureSpec(request.verifier, request.tokenizer_fingerprint, request.aux_indices, request.dtype,
                           request.verifier, request.revision, options.dtype)
    return VllmServerFeatures(spec, options, request.verifier)
