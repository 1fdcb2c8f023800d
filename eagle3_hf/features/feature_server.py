"""Online training from a live feature server: each batch's hidden states computed by vLLM on demand.

`eagle3-hf serve-features --verifier V` keeps vLLM loaded with extract_hidden_states (its own venv, its own
machine if need be); a trainer started with `--features URL` reads the prepared dataset and its
packing plan as `--features hf` does (the verifier in the trainer), and `EndpointFeatureCollator` sends
every document of a row to the server
(the whole sample's token ids, as `extract --engine vllm` prefilled it), turns the states that come back
into exactly the batch offline mode builds, and keeps nothing: the server deletes each file once it has
read it, the bytes travel once, the batch is built and they are dropped. With `--cache-features DIR`
(feature_cache.py) each sample is fetched once, kept in DIR as `extract` would write it, and read from there
afterwards (later epochs, reruns, a resumed run).

"Exactly": the mapping is extract --engine vllm's own (vllm_offline.check_states, features_from_states: aux
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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ..errors import Eagle3Error
from .api_key import api_key, auth_headers, refused_line
from .packing import PackedCollator
from .quantize import as_stored
from .records import canonical_dtype
from .vllm_offline import check_states, features_from_states

if TYPE_CHECKING:
    from torch import nn

    from .feature_cache import FeatureCache
    from .transformers_online import PreparedDataset

# what must match between the server and the training run
IDENTITY_KEYS = ("hidden_size", "num_hidden_layers", "tokenizer_fingerprint")


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


class EndpointFeatureCollator:
    """Rows of a PackedDataset over a PreparedDataset -> offline's batch, the states fetched from a feature server.

    Each distinct sample of a batch is one request (sent together, `max_in_flight` at a time, so the server
    batches them); DataLoader workers keep the next batches' requests in flight while the step runs.
    """

    def __init__(self, client: FeatureClient, prepared: PreparedDataset, norm: nn.Module, head: nn.Module,
                 softcap: float | None, aux_indices: Sequence[int], layer_ids: Sequence[int], hidden: int,
                 max_seq_len: int | None = None, storage_dtype: str | None = "bfloat16", pad_token_id: int = 0,
                 max_in_flight: int = 8, cache: FeatureCache | None = None):
        self.client, self.prepared = client, prepared
        self.norm, self.head, self.softcap = norm, head, softcap
        self.aux_indices, self.layer_ids, self.hidden = list(aux_indices), list(layer_ids), int(hidden)
        self.storage_dtype = canonical_dtype(storage_dtype) if storage_dtype else None
        self.collate = PackedCollator(pad_token_id=pad_token_id, max_seq_len=max_seq_len)
        self.max_in_flight = max(1, int(max_in_flight))
        self._position = {sid: i for i, sid in enumerate(prepared.sample_ids)}
        self.cache = cache  # --cache-features: samples read from DIR, fetched ones written there
        if cache is not None and canonical_dtype(cache.header["dtype"]) != (self.storage_dtype or "float32"):
            raise ValueError(f"--cache-features {cache.dir} stores {cache.header['dtype']}, the batches are rounded "
                             f"to {self.storage_dtype or 'float32'}: they must agree")

    def sample_features(self, sample_id: str) -> dict[str, torch.Tensor]:
        """One whole sample's features (float32, unrounded), fetched and mapped as extract --engine vllm does."""
        input_ids = self.prepared[self._position[sample_id]]["input_ids"].long()
        data = self.client.states(input_ids.tolist(), sample_id)
        states = check_states(data, f"feature server {self.client.url}", sample_id, input_ids, self.layer_ids,
                              self.hidden)
        return features_from_states(states, self.aux_indices, self.layer_ids, self.norm, self.head, self.softcap)

    def rounded(self, f: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole sample's features rounded as a shard stores them (per token row: slicing commutes)."""
        return {"aux_hidden_states": as_stored(f["aux_hidden_states"], len(self.aux_indices), self.storage_dtype),
                "last_hidden_state": as_stored(f["last_hidden_state"], 1, self.storage_dtype),
                "verifier_greedy": f["verifier_greedy"].long()}

    def features(self, wanted: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """{id: rounded features}: from the cache where it holds the sample, else fetched (and cached)."""
        have: dict[str, dict[str, torch.Tensor]] = {}
        if self.cache is not None:
            have = self.cache.get(wanted, {sid: self.prepared[self._position[sid]]["input_ids"].long()
                                           for sid in wanted})
        missing = [sid for sid in wanted if sid not in have]
        if missing:
            with ThreadPoolExecutor(max_workers=min(self.max_in_flight, len(missing)),
                                    thread_name_prefix="eagle3-features") as pool:
                fetched = dict(zip(missing, pool.map(self.sample_features, missing)))
            if self.cache is not None:
                self.cache.put({sid: dict(f, **{k: v for k, v in self.prepared[self._position[sid]].items()
                                                if k in ("input_ids", "loss_mask")}) for sid, f in fetched.items()})
            have.update((sid, self.rounded(f)) for sid, f in fetched.items())
        return have

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        wanted = list(dict.fromkeys(sid for row in rows for sid, _s, _e in row["pieces"]))
        features = self.features(wanted)
        full = []
        for row in rows:
            aux, last, greedy = [], [], []
            for sid, start, end in row["pieces"]:
                f = features[sid]
                aux.append(f["aux_hidden_states"][start:end])
                last.append(f["last_hidden_state"][start:end])
                greedy.append(f["verifier_greedy"][start:end])
            out = {k: v for k, v in row.items() if k != "prefix_input_ids"}
            out.update(aux_hidden_states=torch.cat(aux), last_hidden_state=torch.cat(last),
                       verifier_greedy=torch.cat(greedy))
            full.append(out)
        return self.collate(full)
