"""`eagle3-hf extract --engine vllm`: the features of a prepared dataset, captured by vLLM (an engine of our own in
its venv; a running server is routes/vllm_server_client.py), in our shard format.

The engine that will serve the drafter computes the states it is trained on. vLLM (its own venv,
engines/vllm/vllm_extract_runner.py) prefills each sample's token ids once (max_tokens=1) with its
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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ...data.prepared_samples import PreparedDataset
from ...errors import UsageError
from ..table import FeatureKind, SourceRequest
from ..table import open_source as open_source_of
from ..vllm.vllm_features import VllmFeatures
from ..vllm.vllm_spec import VllmFeatureSpec, VllmOptions
from ..write import ExtractionSummary, StoreOptions, write_features

if TYPE_CHECKING:
    import datasets

def open_source(request: SourceRequest) -> VllmFeatures:
    """The table's opener (table.py) of `--engine vllm`: an engine of our own in vLLM's venv; `request.options`
    is a `VllmOptions` (None: its defaults). A running server is the vllm-server row (routes/vllm_server_client.py)."""
    from ...engines.vllm.vllm_env import vllm_python

    options = request.options if isinstance(request.options, VllmOptions) else VllmOptions()
    if options.endpoint is not None:
        raise UsageError(f"the vllm route runs an engine of its own: {options.endpoint} is the vllm-server route's")
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
    source = open_source_of(SourceRequest(kind, verifier, verifier, revision,
                                          None if aux_indices is None else tuple(aux_indices), dtype,
                                          tokenizer_fingerprint=tokenizer_fingerprint, options=options))
    # as many shards written at once as samples read: one thread cannot hash and write what several read
    store = dataclasses.replace(store or StoreOptions(), writers=getattr(source, "readers", 1))
    prepared = PreparedDataset(prepared_dataset, "all", tokenizer_fingerprint=tokenizer_fingerprint)
    return write_features(source, prepared, out_dir, store=store, progress=progress, desc="extract vllm")
