"""`extract --engine sglang --endpoint URL` and `train --features sglang:URL`: the features of a prepared dataset
from a running SGLang server, written to shards or computed batch by batch while training (collator.py).

SGLang returns EAGLE-3's aux hidden states with stock flags (no patch): started with
`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids IDS`
(the algorithm only names the capture convention; no draft is loaded), a `/generate` request with the sample's
token ids, one greedy token and `"return_hidden_states": true` gets the prompt rows' captured states, concatenated
in layer order, in `meta_info.hidden_states[0]` (JSON floats).

SGLang captures the residual stream *entering* a layer, so it can never return the last layer's output. This route
asks it for one more index than the drafter's three, N-1 (what enters the last layer), and runs that one layer here
(verifier/last_layer.py: transformers' own class, only its tensors read), then the verifier's final norm and head
as every engine route does (engine_states.features_from_states). In fp32 on SmolLM2 the result is transformers'
`output_hidden_states` bit for bit at most prompt lengths, within fp32 rounding at the others (docs/contracts.md).
A mixture-of-experts last layer is loaded from its per-expert tensors by transformers' own conversion; one larger
than the memory free where it would run (Kimi-K2.5's: 17 B parameters, 68 GB in fp32) is refused in one line
before the server is asked anything: such verifiers go through `extract --engine vllm`.

The ids the server must be started with are the capture indices through the reader of the verifier's SGLang family
and release (publish/aux_id_rules.py `sglang_ids_to_send`: Llama-family files add 1 to every id, DeepSeek-V3 /
Kimi only when the first id is 1); `check` compares them with the server's /server_info and refuses a server that
captures others, serves another model, or caches prefixes (a cached prefix is not recomputed, so its rows' states
are missing). Each sample is one request, `requests` in flight, each bounded in bytes (what its rows can take as
JSON) and time, 5xx answers and dropped connections retried; every answer is checked for its row count, width and
finiteness, and SGLang's own next token must agree with the greedy token computed here on at least one of the first
PROBE samples (else the run stops, nothing written). Each refusal is one line naming the sample.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import EndpointError, UsageError
from ...verifier.family import check_aux_indices, default_aux_indices, logit_softcap
from ..api_key import api_key, auth_headers, refused_line
from ..engine_states import PROBE, all_finite, features_from_states
from ..interface import PreparedSample, SampleFeatures, SourceIdentity, VerifierIdentity
from ..records import DTYPES, canonical_dtype
from ..table import OnlineOptions, SourceRequest
from ..write import sample_token_limit

SOURCE = "sglang"
INFO_LIMIT = 4 << 20  # bytes of /server_info (its server args and scheduler state: tens of KiB)
BYTES_PER_VALUE = 32  # at most, per float of an answer as JSON ("-1.2345678901234567e-05, ")
LAUNCH = ("--enable-return-aux-hidden-states --speculative-algorithm EAGLE3 --disable-radix-cache "
          "--return-aux-hidden-state-layer-ids")


@dataclass(frozen=True)
class SglangOptions:
    """`extract --engine sglang`'s own options: the server, requests in flight, seconds and retries per request,
    and the device the verifier's last layer, norm and head run on (default: the accelerator when there is one)."""

    endpoint: str = ""
    requests: int = 4
    timeout: float = 600.0
    retries: int = 3
    backoff_s: float = 1.0
    max_model_len: int | None = None
    device: str | None = None

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("--engine sglang (a running SGLang server computes the states; --endpoint "
                                          "URL, started with aux capture: docs/guide.md)")
        group.add_argument("--sglang-requests", type=int, default=4, metavar="N",
                           help="requests in flight, one sample each (default %(default)s)")
        group.add_argument("--sglang-timeout", type=float, default=600.0, metavar="S",
                           help="seconds per request, its answer included (default %(default)s)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SglangOptions:
        """Checked: the server runs the verifier (no placement here but --device, where its last layer, norm and
        head run), its URL given, the request knobs in range."""
        if any(getattr(args, name, None) for name in ("device_map", "max_memory", "offload_folder")):
            raise UsageError("--engine sglang runs the verifier in its server: drop --device-map/--max-memory/"
                             "--offload-folder (--device places the last layer, norm and head run here)")
        if not getattr(args, "endpoint", None):
            raise UsageError("--engine sglang needs --endpoint URL (a running SGLang server started with "
                             f"{LAUNCH} ...: docs/guide.md)")
        if args.sglang_requests < 1 or args.sglang_timeout <= 0:
            raise UsageError("--sglang-requests must be at least 1 and --sglang-timeout positive")
        return cls(str(args.endpoint).rstrip("/"), args.sglang_requests, args.sglang_timeout,
                   max_model_len=getattr(args, "max_model_len", None), device=getattr(args, "device", None))

    def close(self) -> None:
        """Nothing to release: the server is the user's."""


def json_parser() -> tuple[str, Callable[[bytes], Any]]:
    """orjson's `loads` where it is installed (this project's `sglang` extra), else the standard library's: an
    answer holds tens of thousands of numbers per token, and parsing them is this route's own cost
    (bench/sglang_answer.py). Both parse a number to the same float."""
    try:
        import orjson
    except ImportError:
        return "json", json.loads
    return "orjson", orjson.loads


class SglangClient:
    """GET and POST JSON to one SGLang server: bounded bytes and time, 5xx and dropped connections retried with
    backoff, $EAGLE3_HF_API_KEY sent as a bearer token (SGLang's --api-key)."""

    def __init__(self, url: str, timeout: float = 600.0, retries: int = 3, backoff_s: float = 1.0):
        self.url, self.timeout, self.retries, self.backoff_s = url.rstrip("/"), timeout, retries, backoff_s
        self.key = api_key()
        self.parser, self.loads = json_parser()

    def call(self, path: str, body: dict[str, Any] | None, limit: int, what: str) -> Any:
        from ...engines.vllm.vllm_openai import read_answer

        data = None if body is None else json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url + path, data=data, headers={
                "Content-Type": "application/json", **auth_headers(self.key)})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    return read_answer(response, self.url + path, time.monotonic() + self.timeout, limit,
                                       self.loads)
            except urllib.error.HTTPError as exc:
                if exc.code == 401:
                    raise EndpointError(refused_line(self.url, self.key)) from None
                if exc.code < 500 or attempt == self.retries:
                    raise EndpointError(f"{self.url}{path} answered {exc.code} for {what}: "
                                        f"{_error_text(exc)}") from None
            except (urllib.error.URLError, ConnectionError) as exc:
                if attempt == self.retries:
                    reason = getattr(exc, "reason", exc)
                    raise EndpointError(f"no SGLang server answers at {self.url} ({reason}) for {what}") from None
            except TimeoutError:
                raise EndpointError(f"{self.url}{path} did not answer {what} within {self.timeout:.0f} s "
                                    "(--sglang-timeout sets the limit)") from None
            except ValueError as exc:  # over the byte limit, or not JSON
                raise EndpointError(f"{exc} ({what})") from None
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def server_info(self) -> dict[str, Any]:
        """/server_info (0.5.23; /get_server_info before it): the server's resolved arguments and `version`."""
        for path in ("/server_info", "/get_server_info"):
            try:
                info = self.call(path, None, INFO_LIMIT, "its server info")
            except EndpointError as exc:
                if " answered 404 " in str(exc) and path == "/server_info":
                    continue
                raise
            if not isinstance(info, dict):
                raise EndpointError(f"{self.url}{path} answered something that is not a JSON object")
            return info
        raise AssertionError("unreachable")


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(exc.read() or b"{}")
    except ValueError:
        return str(exc.reason)
    message = body.get("error", body.get("message", body)) if isinstance(body, dict) else body
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message)[:300]


class SglangFeatures:
    """A running SGLang server as a `FeatureSource` (module docstring). Opening it reads the server's /server_info
    (its version picks the id reader); `check` refuses a server that cannot give this verifier's states."""

    def __init__(self, request: SourceRequest, options: SglangOptions):
        from ...publish.aux_id_rules import sglang_family, sglang_ids_to_send
        from ...verifier.checkpoint_files import CheckpointFiles
        from ...verifier.greedy import head_device
        from ...verifier.head import load_verifier_head
        from ...verifier.last_layer import check_fits, plan_last_layer
        from ...verifier.loading import resolve_verifier

        self.options, self.verifier = options, request.verifier
        self.path = resolve_verifier(request.verifier)
        self.device = torch.device(options.device) if options.device else head_device()
        # the last layer runs here: one that cannot fit is refused before the server is asked anything
        check_fits(plan_last_layer(self.path, request.revision, request.trust_remote_code, request.verifier),
                   self.device)
        self.client = SglangClient(options.endpoint, options.timeout, options.retries, options.backoff_s)
        self.info = self.client.server_info()
        self.version = str(self.info.get("version") or "") or None
        self.norm, self.head, config = load_verifier_head(self.path, request.revision, device=self.device)
        self.num_layers, self.hidden = int(config.num_hidden_layers), int(config.hidden_size)
        self.softcap = logit_softcap(config)
        n = self.num_layers
        self.indices = check_aux_indices(request.aux_indices or default_aux_indices(n), n)
        self.captured = sorted(set(self.indices) | {n - 1})  # SGLang concatenates in layer order
        self.family = sglang_family(CheckpointFiles(self.path, request.revision).config().get("architectures"))
        self.layer_ids = sglang_ids_to_send(self.captured, self.family, n, self.version)
        self.revision, self.trust_remote_code = request.revision, request.trust_remote_code
        self.last_layer: Any = None  # loaded by check(), once the server is known to fit
        who = VerifierIdentity.of(config, request.verifier, request.revision, files=self.path)
        provenance = {"engine": "sglang", "sglang_version": self.version, "sglang_layer_ids": self.layer_ids,
                      "sglang_family": self.family, "sglang_dtype": self.info.get("dtype"),
                      "captured_indices": self.captured,
                      "last_hidden_state": f"the verifier's layer {n - 1} run here on SGLang's capture of index "
                                           f"{n - 1}, then its final norm",
                      "verifier_greedy": "argmax of the verifier's lm_head (with its soft-cap) on last_hidden_state"}
        self.identity = SourceIdentity(who, request.tokenizer_fingerprint, tuple(self.indices),
                                       canonical_dtype(request.dtype), SOURCE, provenance)
        self.checks = self.agreements = 0
        self.tokens = 0

    # ---------------------------------------------------------------- before anything is written

    def check(self, lengths: Sequence[int]) -> int | None:
        """The server fits this verifier and capture (one line each refusal); returns the most tokens a sample may
        have: the server's longest prompt or --max-model-len less the generated token, whichever is shorter."""
        from ...verifier.last_layer import LastLayer

        info, url = self.info, self.client.url
        served = str(info.get("model_path") or "")
        wanted = {str(self.verifier), str(self.path), os.path.realpath(self.path)}
        if served not in wanted and os.path.realpath(served) not in wanted:
            raise EndpointError(f"{url} serves {served or 'an unnamed model'}, not the verifier {self.verifier} "
                                "(--verifier must name the server's --model-path)")
        ids = info.get("return_aux_hidden_state_layer_ids")
        if not info.get("enable_return_aux_hidden_states") or ids is None:
            raise EndpointError(f"{url} does not return aux hidden states at named layers: start it with {LAUNCH} "
                                f"{' '.join(map(str, self.layer_ids))}")
        if sorted(int(i) for i in ids) != self.layer_ids:
            raise EndpointError(f"{url} captures SGLang layer ids {list(ids)}; this extraction needs "
                                f"{self.layer_ids} (indices {self.captured} for the {self.family or 'unknown'} "
                                f"family in SGLang {self.version}): start it with {LAUNCH} "
                                f"{' '.join(map(str, self.layer_ids))}")
        if not info.get("disable_radix_cache", False):
            raise EndpointError(f"{url} caches prefixes (radix cache): a cached prefix is not recomputed and its "
                                "rows' states are not returned; start it with --disable-radix-cache")
        self.last_layer = LastLayer(self.path, self.revision, self.device, self.trust_remote_code)
        limit = sample_token_limit(self.options.max_model_len)
        longest = info.get("max_req_input_len")  # the longest prompt it takes (its context less what it generates)
        takes = int(longest) if longest else sample_token_limit(info.get("context_length"))
        return takes if limit is None or (takes is not None and takes < limit) else limit

    # ---------------------------------------------------------------- the samples

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        from ..ordered_pool import ordered_map

        if self.last_layer is None:
            raise RuntimeError("SglangFeatures.check must run before states")
        held: list[SampleFeatures] = []
        for sample, (rows, next_token) in ordered_map(lambda s: (s, self.ask(s)), samples, self.options.requests,
                                                      name="eagle3-sglang"):
            feats = self.features(sample, rows)
            if next_token is not None and self.agreements == 0:
                self.vouch(next_token, int(feats.verifier_greedy[-1]), sample.sample_id)
            held.append(feats)
            if self.agreements:
                yield from held
                held.clear()
        if held:  # fewer samples than PROBE, none of whose next tokens agreed
            self.refuse_unvouched(held[-1].sample.sample_id)

    def ask(self, sample: PreparedSample) -> tuple[torch.Tensor, int | None]:
        """One request: the sample's captured rows [T, L, H] (checked) and SGLang's own next token."""
        ids = [int(i) for i in sample.input_ids.tolist()]
        width = len(self.layer_ids) * self.hidden
        limit = (len(ids) + 2) * width * BYTES_PER_VALUE + (1 << 20)
        answer = self.client.call("/generate", {
            "input_ids": ids, "return_hidden_states": True, "stream": False,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}, limit, f"sample {sample.sample_id!r}")
        rows = check_answer(answer, self.client.url, sample.sample_id, len(ids), len(self.layer_ids), self.hidden)
        self.tokens += len(ids)
        out = answer.get("output_ids")
        next_token = int(out[0]) if isinstance(out, list) and out and isinstance(out[0], int) else None
        return rows, next_token

    def features(self, sample: PreparedSample, rows: torch.Tensor) -> SampleFeatures:
        """SGLang's [T, L, H] -> our features: the aux states as captured, the last layer run here on index N-1,
        then the final norm and head (engine_states.features_from_states)."""
        n = self.num_layers
        slot = {index: j for j, index in enumerate(self.captured)}
        pre = self.last_layer(rows[:, slot[n - 1]])  # [T, H] the last layer's output, before the final norm
        stacked = torch.stack([rows[:, slot[i]] for i in self.indices] + [pre.to(rows.device)], dim=1)  # [T, 4, H]
        dtype = self.identity.dtype
        feats = features_from_states(stacked, self.indices, [*self.indices, n], self.norm, self.head, self.softcap,
                                     dtype=None if dtype == "float8_e4m3fn" else DTYPES[dtype])
        return SampleFeatures(sample, feats["aux_hidden_states"], feats["last_hidden_state"], feats["verifier_greedy"])

    def vouch(self, served: int, greedy: int, sample_id: str) -> None:
        self.checks += 1
        self.agreements += int(served == greedy)
        if self.checks == PROBE:
            self.refuse_unvouched(sample_id)

    def refuse_unvouched(self, sample_id: str) -> None:
        if self.agreements == 0:
            raise EndpointError(f"{self.client.url}'s next token differs from the verifier's greedy token computed "
                                f"from its states for all of the first {self.checks} samples (last {sample_id!r}): "
                                f"it does not capture indices {self.captured} of {self.verifier}")

    def report(self) -> dict[str, Any]:
        return {"engine": "sglang", "endpoint": self.client.url, "sglang_version": self.version,
                "sglang_layer_ids": self.layer_ids, "sglang_dtype": self.info.get("dtype"),
                "prompt_tokens": self.tokens, "json_parser": self.client.parser,
                "next_token_agreement": round(self.agreements / max(self.checks, 1), 4)}


def check_answer(answer: Any, url: str, sample_id: str, tokens: int, layers: int, hidden: int) -> torch.Tensor:
    """`meta_info.hidden_states[0]` of a /generate answer as [T, layers, H] float32: one line (EndpointError)
    naming the sample when it is missing, has another row count or width, or holds a non-finite value."""
    where = f"{url}/generate for sample {sample_id!r}"
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    states = meta.get("hidden_states") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not isinstance(states, list) or not states:
        raise EndpointError(f"{where} answered without meta_info.hidden_states: start the server with {LAUNCH} ...")
    try:
        rows = torch.tensor(states[0], dtype=torch.float32)
    except (TypeError, ValueError):
        nulls = null_layers(states[0], hidden)  # SGLang's orjson writes NaN and infinity as null
        if nulls:
            raise EndpointError(f"{where}: non-finite states in captured layers {nulls} (0-based, in layer order; "
                                "sent as null)") from None
        raise EndpointError(f"{where}: meta_info.hidden_states[0] is not a table of numbers") from None
    prompt = meta.get("prompt_tokens")
    if rows.dim() != 2 or rows.shape[0] != tokens or (prompt is not None and prompt != tokens):
        raise EndpointError(f"{where}: {tuple(rows.shape)} states for a prompt of {tokens} tokens (prompt_tokens "
                            f"{prompt}); a cached prefix returns fewer rows: start it with --disable-radix-cache")
    if rows.shape[1] != layers * hidden:
        raise EndpointError(f"{where}: rows of {rows.shape[1]} values, expected {layers} layers x hidden {hidden}")
    if not all_finite(rows):
        bad = sorted({int(c) // hidden for c in torch.nonzero(~torch.isfinite(rows))[:, 1].tolist()})
        raise EndpointError(f"{where}: non-finite states in captured layers {bad} (0-based, in layer order)")
    return rows.view(tokens, layers, hidden)


def null_layers(table: Any, hidden: int) -> list[int]:
    """The captured layers (0-based, in layer order) where a row of `table` holds null."""
    rows = table if isinstance(table, list) else []
    return sorted({j // hidden for row in rows if isinstance(row, list) for j, v in enumerate(row) if v is None})


def served_model(target: str) -> tuple[str | None, str | None]:
    """(name, revision) of the verifier `train --features sglang:URL` names: the server's --model-path."""
    served = SglangClient(target, retries=0).server_info().get("model_path")
    return (str(served) if served else None), None


def open_source(request: SourceRequest) -> SglangFeatures:
    """The table's opener (table.py): `request.options` is a SglangOptions, or the online routes' options
    (their timeout and retries, the endpoint from `request.target`)."""
    options = request.options
    if not isinstance(options, SglangOptions):
        online = options if isinstance(options, OnlineOptions) else OnlineOptions()
        options = SglangOptions(request.target, timeout=online.timeout, retries=online.retries)
    if not options.endpoint:
        raise UsageError("--engine sglang needs --endpoint URL")
    return SglangFeatures(request, options)
