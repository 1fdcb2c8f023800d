"""Online training from a live feature server: each batch's hidden states computed by vLLM on demand.

`eagle3-hf serve-features --verifier V` keeps vLLM loaded with extract_hidden_states (its own venv, its own
machine if need be); a trainer started with `--features URL` reads the prepared dataset and its
packing plan as `--features hf` does (the verifier in the trainer), and the one online collator
(collator.FeatureCollator) asks this route (`ServerFeatures`) for every document of a batch: the whole sample's
token ids, as `extract --engine vllm` prefilled it, are sent to the server, the states that come back are turned
into exactly the batch offline mode builds, and nothing is kept: the server deletes each file once it has
read it, the bytes travel once, the batch is built and they are dropped. With `--cache-features DIR`
(feature_cache.py) each sample is fetched once, kept in DIR as `extract` would write it, and read from there
afterwards (later epochs, reruns, a resumed run).

"Exactly": the mapping is extract --engine vllm's own (engine_states.check_states, features_from_states: aux
states as vLLM wrote them, the verifier's final norm applied once to vLLM's id N, its lm_head with its
soft-cap for verifier_greedy), on the whole sample, rounded as a shard of `storage_dtype` stores it
(quantize.quantize/dequantize, per token row, so rounding then slicing to the piece equals the reverse). With
the same rounding as the offline shards, the batch is bit-equal to the offline one when vLLM returns the same
states for the same sample.

Faults: the server unreachable, or one serving another verifier (hidden size, layer count, tokenizer
fingerprint), is refused before the first step, one line; a request that times out or finds the server
down (restarting) is retried `retries` times with a growing pause, the server's identity checked again
once it answers, then one line naming the sample; a server that is busy (503) is retried the same way,
waiting at least its Retry-After; non-finite states are refused like offline ones.

Every request carries $EAGLE3_HF_API_KEY as a bearer token when it is set; a server that answers 401 is one
line saying whether a key was sent (never the key).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ...errors import Eagle3Error
from ..api_key import api_key, auth_headers, refused_line
from ..engine_states import check_states, features_from_states
from ..interface import PreparedSample, SampleFeatures, SourceIdentity, VerifierIdentity
from ..records import canonical_dtype

if TYPE_CHECKING:
    from torch import nn

    from ..table import SourceRequest

# what must match between the server and the training run
IDENTITY_KEYS = ("hidden_size", "num_hidden_layers", "tokenizer_fingerprint")
MAX_IN_FLIGHT = 8  # requests of one batch sent at once (the server batches them)


class FeatureServerError(Eagle3Error):
    """The feature server unreachable, serving another verifier, or failing a sample after the retries."""


class FeatureClient:
    """HTTP client of one feature server (vllm_feature_server.py): identity, and one sample's states."""

    def __init__(self, url: str, timeout: float = 600.0, retries: int = 3, backoff_s: float = 1.0,
                 key: str | None = None):
        self.url = url.rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise FeatureServerError(f"--features {url!r}: an http:// URL, as `eagle3-hf serve-features` "
                                     "prints it")
        self.timeout, self.retries, self.backoff_s = float(timeout), int(retries), float(backoff_s)
        self.key = key if key is not None else api_key()  # $EAGLE3_HF_API_KEY unless given
        self.expected: dict[str, Any] | None = None  # the identity checked at start
        self.requests = 0
        self.wait_s = 0.0  # seconds spent in requests (this process)

    def _get(self, path: str, timeout: float) -> dict[str, Any]:
        request = urllib.request.Request(self.url + path, headers=auth_headers(self.key))
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            record: dict[str, Any] = json.loads(answer.read())
        return record

    def identity(self, timeout: float = 10.0) -> dict[str, Any]:
        """GET /identity; FeatureServerError (one line) when nothing answers there or the key is refused."""
        try:
            return self._get("/identity", timeout)
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                raise FeatureServerError(f"feature server {refused_line(self.url, self.key)}") from None
            raise FeatureServerError(f"feature server {self.url} answered {exc.code} to GET /identity") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise FeatureServerError(f"feature server {self.url} unreachable ({reason}): start it with "
                                     "`eagle3-hf serve-features --verifier V` and pass the URL it prints") from None

    def check(self, expected: dict[str, Any], names: dict[str, str] | None = None) -> dict[str, Any]:
        """The server's identity, refused (one line) where it differs from `expected` (IDENTITY_KEYS)."""
        found = self.identity()
        differ = [k for k in IDENTITY_KEYS if k in expected and found.get(k) != expected[k]]
        if differ:
            names = names or {}
            what = "; ".join(f"{k} {found.get(k)!r} (training: {expected[k]!r}{names.get(k, '')})" for k in differ)
            raise FeatureServerError(f"feature server {self.url} serves verifier {found.get('verifier')!r} with "
                                     f"{what}: start it with the verifier you train for")
        self.expected = {k: found.get(k) for k in IDENTITY_KEYS}
        return found

    def states(self, ids: list[int], sample_id: str) -> dict[str, torch.Tensor]:
        """POST /features for one sample: {hidden_states, token_ids}; retried on timeouts and a server that is
        down (restarting) or busy (503: the pause is at least its Retry-After), then FeatureServerError naming
        the sample. A request the server refuses (400, 401) is not retried."""
        from safetensors.torch import load as load_safetensors

        body = json.dumps({"ids": ids}).encode()
        last = ""
        retry_after = 0.0
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(30.0, max(retry_after, self.backoff_s * 2 ** (attempt - 1))))
                retry_after = 0.0
            start = time.perf_counter()
            try:
                request = urllib.request.Request(self.url + "/features", data=body, method="POST",
                                                 headers={"Content-Type": "application/json",
                                                          **auth_headers(self.key)})
                with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                    data = answer.read()
                self.requests += 1
                return load_safetensors(data)
            except urllib.error.HTTPError as exc:
                if exc.code == 401:
                    raise FeatureServerError(f"feature server {refused_line(self.url, self.key)}") from None
                try:
                    last = json.loads(exc.read()).get("error") or f"HTTP {exc.code}"
                except (ValueError, AttributeError):
                    last = f"HTTP {exc.code}"
                if 400 <= exc.code < 500:
                    break
                if exc.code == 503:
                    retry_after = retry_after_s(exc.headers.get("Retry-After"))
            except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
                reason = getattr(exc, "reason", None) or exc
                last = "timed out" if isinstance(reason, (socket.timeout, TimeoutError)) else str(reason)
                self._recheck()
            finally:
                self.wait_s += time.perf_counter() - start
        tries = "once" if attempt == 0 else f"{attempt + 1} times"
        limit = f"; --online-timeout {self.timeout:g} s" if last == "timed out" else ""
        raise FeatureServerError(f"feature server {self.url}: sample {sample_id!r} failed {tries} ({last}{limit})")

    def _recheck(self) -> None:
        """After a connection failure: a server that came back must still serve the same verifier."""
        if self.expected is None:
            return
        try:
            found = self.identity(timeout=5.0)
        except FeatureServerError:
            return  # still down: the next attempt finds out
        differ = [k for k in IDENTITY_KEYS if found.get(k) != self.expected.get(k)]
        if differ:
            raise FeatureServerError(f"feature server {self.url} came back serving another verifier "
                                     f"({', '.join(f'{k} {found.get(k)!r}' for k in differ)})")


def retry_after_s(value: str | None) -> float:
    """A Retry-After header's seconds (0 when absent or not a number of seconds), at most 30."""
    try:
        return min(30.0, max(0.0, float(value or 0)))
    except ValueError:
        return 0.0


class ServerFeatures:
    """A feature server as a `FeatureSource`: each sample one request (`max_in_flight` at a time, so the server
    batches them), its states checked and mapped exactly as `extract --engine vllm` maps a file (engine_states)."""

    def __init__(self, client: FeatureClient, served: Mapping[str, Any], norm: nn.Module, head: nn.Module,
                 softcap: float | None, identity: SourceIdentity, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.client, self.norm, self.head, self.softcap, self.identity = client, norm, head, softcap, identity
        self.layer_ids = [int(i) for i in served["layer_ids"]]
        self.hidden = identity.verifier.hidden_size
        self.max_in_flight = max(1, int(max_in_flight))

    def check(self, lengths: Sequence[int]) -> int | None:
        return None  # the server takes any sample its own context takes, and says so per request

    def sample_features(self, sample: PreparedSample) -> SampleFeatures:
        """One whole sample's features (float32, unrounded), fetched and mapped as extract --engine vllm does."""
        data = self.client.states(sample.input_ids.tolist(), sample.sample_id)
        states = check_states(data, f"feature server {self.client.url}", sample.sample_id, sample.input_ids,
                              self.layer_ids, self.hidden)
        f = features_from_states(states, self.identity.aux_layer_indices, self.layer_ids, self.norm, self.head,
                                 self.softcap)
        return SampleFeatures(sample, f["aux_hidden_states"], f["last_hidden_state"], f["verifier_greedy"])

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        if not samples:
            return
        with ThreadPoolExecutor(max_workers=min(self.max_in_flight, len(samples)),
                                thread_name_prefix="eagle3-features") as pool:
            yield from pool.map(self.sample_features, samples)

    def report(self) -> dict[str, Any]:
        return {"engine": "vllm", "feature_server": self.client.url, "requests": self.client.requests,
                "request_seconds": round(self.client.wait_s, 3)}


def served_identity(url: str, served: Mapping[str, Any], dtype: str, tokenizer_fingerprint: str | None = None,
                    vocab_size: int | None = None) -> SourceIdentity:
    """A feature server's GET /identity as the SourceIdentity of what it serves (the verifier it names, its widths
    and hashes; vLLM's layer ids in the provenance), its features stored as `dtype`. `vocab_size` stands in where
    the server does not report one."""
    hashes = served.get("verifier_identity") or {}
    verifier = VerifierIdentity(str(served.get("verifier") or url), served.get("verifier_revision"),
                                int(served["num_hidden_layers"]), int(served["hidden_size"]),
                                int(served.get("vocab_size") or vocab_size or 0),
                                *(str(hashes[k]) if isinstance(hashes, dict) and hashes.get(k) else None
                                  for k in ("config_sha256", "head_sha256")))
    provenance = {"engine": "vllm", "feature_server": url, "vllm_version": served.get("vllm_version"),
                  "vllm_layer_ids": [int(i) for i in served["layer_ids"]]}
    return SourceIdentity(verifier, str(tokenizer_fingerprint or served.get("tokenizer_fingerprint")),
                          tuple(int(i) for i in served["aux_layer_indices"]), canonical_dtype(dtype), "vllm",
                          provenance)


def open_source(request: SourceRequest) -> ServerFeatures:
    """The table's opener (table.py): the server at `request.target`, its identity checked before the verifier's
    final norm and head are read (from `request.verifier`)."""
    from ...verifier.family import logit_softcap, text_config
    from ...verifier.head import load_verifier_head
    from ...verifier.loading import load_config, resolve_verifier
    from ..table import OnlineOptions

    options = request.options if isinstance(request.options, OnlineOptions) else OnlineOptions()
    path = resolve_verifier(request.verifier)
    config = text_config(load_config(path, revision=request.revision))
    client = FeatureClient(request.target, timeout=options.timeout, retries=options.retries)
    expected = {"hidden_size": int(config.hidden_size), "num_hidden_layers": int(config.num_hidden_layers),
                "tokenizer_fingerprint": request.tokenizer_fingerprint}
    served = client.check(expected, names={"hidden_size": f", {request.verifier}",
                                           "num_hidden_layers": f", {request.verifier}",
                                           "tokenizer_fingerprint": f", {options.prepared_dir}"})
    norm, head, _ = load_verifier_head(path, request.revision)
    identity = served_identity(client.url, served, request.dtype, request.tokenizer_fingerprint,
                               int(config.vocab_size))
    return ServerFeatures(client, served, norm, head, logit_softcap(config), identity, MAX_IN_FLIGHT)


def served_verifier(target: str) -> tuple[str | None, str | None]:
    """(name, revision) of the verifier a feature server names; unreachable or a refused key: one line now."""
    found = FeatureClient(target, retries=0).identity()
    return (str(found["verifier"]) if found.get("verifier") else None), found.get("verifier_revision")
