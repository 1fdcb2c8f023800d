"""`eagle3-hf extract --engine vllm`: the features of a prepared dataset, captured by vLLM, in our shard format.

The engine that will serve the drafter computes the states it is trained on. vLLM (its own venv,
engines/vllm_extract_runner.py) prefills each sample's token ids once (max_tokens=1) with its
`extract_hidden_states` method at ids = the aux indices + [N]: vLLM's id k < N is transformers'
`output_hidden_states` index k (the residual stream entering layer k), and id N is the last layer's output
*before* the final norm. So the aux states are stored as vLLM wrote them, and here, in this venv, the
verifier's own final norm turns id N into `last_hidden_state` (post-norm, as our shards define it) and its
own `lm_head` (with its soft-cap) gives `verifier_greedy`: the same functions `import-features` uses
(verifier/head.load_verifier_head, capture.greedy_tokens), on the accelerator when there is one (bf16 head,
fp32 rescoring: verifier/greedy.py). Only the norm and the head are read from the checkpoint, never the body.
vLLM's runner only writes files; each is checked (token ids, rows, layers, hidden size, finite), taken into a
shard and deleted at once, by several reader threads (`--vllm-readers`) that work in the file's dtype and hand
the samples on in the engine's order.

Same shards, keys, dtypes, checksums, manifest and resumption as `extract` (write.write_features); the
manifest's `source` is "vllm". Ranks (RANK / WORLD_SIZE) split the samples as `extract` does, each with
its own vLLM instance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...data.prepared_samples import PreparedDataset
from ..interface import PreparedSample, SampleFeatures
from ..table import FeatureKind, SourceRequest
from ..vllm_spec import VllmFeatureSpec, VllmOptions, default_readers
from ..write import ExtractionSummary, StoreOptions, sample_token_limit, write_features

if TYPE_CHECKING:
    import datasets

    from .vllm_server_client import EndpointExtraction

ENDPOINT_TIMEOUT_S = 600.0  # one completion (and its file) from a running server; --vllm-timeout overrides


class VllmFeatures:
    """vLLM as a `FeatureSource`: an engine of our own in vLLM's venv (`VllmExtraction`), or a running OpenAI
    server started by `serve-vllm` (`options.endpoint`; features/routes/vllm_server_client.py), with `batch_size`
    requests in flight. `verifier` is the name a server is checked against."""

    def __init__(self, spec: VllmFeatureSpec, options: VllmOptions | None = None, verifier: str = ""):
        self.spec, self.identity = spec, spec.identity
        self.options, self.verifier = options or VllmOptions(), verifier
        self.readers = default_readers() if self.options.readers is None else max(1, int(self.options.readers))
        self.served: dict[str, Any] | None = None
        self.result: dict[str, Any] = {}
        self.peak = 0

    def check(self, lengths: Sequence[int]) -> int | None:
        """The server checked (with an endpoint); returns the most tokens a sample may have: --max-model-len's or a
        server's context, whichever is shorter, less the generated token (write.sample_token_limit)."""
        options = self.options
        limit = sample_token_limit(options.max_model_len)
        if options.endpoint is not None:
            from .vllm_server_client import check_server

            # the only directory whose files a server may name (vllm_server.py)
            self.served = check_server(options.endpoint, self.verifier, self.spec.path, self.spec.layer_ids,
                                       options.storage)
            served = sample_token_limit(self.served.get("max_model_len"))
            if served is not None and (limit is None or served < limit):
                limit = served
        return limit

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        from ...engines.vllm_env import VllmExtraction

        options = self.options
        longest = max((len(s.input_ids) for s in samples), default=0)  # the samples that fit (write.py)
        request = self.spec.request(int(options.max_model_len or longest + 1), options.batch_size,
                                    options.max_pending, dict(options.engine), options.connector)
        prompts = ((k, samples[k].input_ids.tolist()) for k in range(len(samples)))
        run: VllmExtraction | EndpointExtraction
        if self.served is not None:
            from .vllm_server_client import EndpointExtraction

            run = EndpointExtraction(str(options.endpoint), prompts, model=str(self.served["id"]),
                                     concurrency=options.batch_size,
                                     timeout=ENDPOINT_TIMEOUT_S if options.timeout is None else options.timeout,
                                     storage=self.served["storage"])
        else:
            run = VllmExtraction(request, prompts, threads=options.threads, debug=options.debug,
                                 timeout=options.timeout)
        with run:
            yield from self.spec.features(run.records(), samples, readers=self.readers)
            self.result = run.result or {}
            self.peak = run.peak_pending_bytes

    def report(self) -> dict[str, Any]:
        """The route's facts; "connector" is None from a server (its answers do not name it)."""
        out = {"engine": "vllm", "vllm_version": self.result.get("vllm_version"), "vllm_dtype": self.spec.vllm_dtype,
               "connector": self.result.get("connector"), "vllm_load_seconds": self.result.get("load_seconds"),
               "peak_temporary_bytes": self.peak, "readers": self.readers}
        if self.options.endpoint is not None:
            spec = self.spec
            out.update(endpoint=self.options.endpoint,
                       next_token_agreement=round(spec.next_token_agreements / max(spec.next_token_checks, 1), 4))
        return out


def open_source(request: SourceRequest) -> VllmFeatures:
    """The table's opener (table.py) of `--engine vllm` and, with `options.endpoint`, of a running vLLM OpenAI
    server (then no vLLM is needed here): `request.options` is a `VllmOptions` (None: its defaults)."""
    from ...engines.vllm_env import vllm_python

    options = request.options if isinstance(request.options, VllmOptions) else VllmOptions()
    if options.endpoint is None:
        vllm_python()  # vLLM missing: one line, before anything is written
    spec = VllmFeatureSpec(request.verifier, request.tokenizer_fingerprint, request.aux_indices, request.dtype,
                           request.verifier, request.revision, options.dtype)
    return VllmFeatures(spec, options, request.verifier)


def extract_features_vllm(verifier: str, tokenizer_fingerprint: str, prepared_dataset: datasets.Dataset | str | Path,
                          out_dir: str | Path, *, aux_indices: Sequence[int] | None = None, dtype: str = "bfloat16",
                          revision: str | None = None, options: VllmOptions | None = None,
                          store: StoreOptions | None = None, progress: bool = True) -> ExtractionSummary:
    """Write vLLM's features for this rank's slice of `prepared_dataset` to `out_dir` (the rank from RANK /
    WORLD_SIZE, as `extract`)."""
    kind: FeatureKind = "vllm" if options is None or options.endpoint is None else "vllm-server"
    source = open_source(SourceRequest(kind, verifier, verifier, revision,
                                       None if aux_indices is None else tuple(aux_indices), dtype,
                                       tokenizer_fingerprint=tokenizer_fingerprint, options=options))
    # as many shards written at once as samples read: one thread cannot hash and write what several read
    store = dataclasses.replace(store or StoreOptions(), writers=source.readers)
    prepared = PreparedDataset(prepared_dataset, "all", tokenizer_fingerprint=tokenizer_fingerprint)
    return write_features(source, prepared, out_dir, store=store, progress=progress, desc="extract vllm")
