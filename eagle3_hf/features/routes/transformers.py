"""The transformers route: the verifier in this process, through forward hooks (`extract --engine transformers`,
`train --features hf`).

One verifier forward per sample (no padding, so a sample's features do not depend on its neighbours and a resumed
run is bit-identical to an uninterrupted one). `extract_features` is the route written to shards from Python, as
`eagle3-hf extract` (features/commands/extract.py) writes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...data.prepared_samples import PreparedDataset
from ...errors import UsageError
from ...verifier.capture import capture_features
from ...verifier.family import check_aux_indices, default_aux_indices
from ...verifier.placement import add_placement_arguments, placement_kwargs
from ..interface import PreparedSample, SampleFeatures, SourceIdentity, VerifierIdentity
from ..records import canonical_dtype
from ..table import SourceRequest
from ..write import ExtractionSummary, StoreOptions, sample_token_limit, write_features

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedModel


def verifier_info(verifier: PreTrainedModel, name: str | None = None, revision: str | None = None) -> dict[str, Any]:
    """The manifest's `verifier` record of a loaded verifier."""
    return VerifierIdentity.of_model(verifier, name, revision).as_dict()


class TransformersFeatures:
    """The verifier in this process, through forward hooks: one forward per sample, no padding, so a sample's
    features do not depend on its neighbours and a resumed run is bit-identical to an uninterrupted one."""

    def __init__(self, verifier: PreTrainedModel, tokenizer_fingerprint: str, aux_indices: Sequence[int] | None = None,
                 dtype: str = "bfloat16", verifier_name: str | None = None, verifier_revision: str | None = None,
                 max_model_len: int | None = None):
        self.verifier = verifier
        self.max_sample_tokens = sample_token_limit(max_model_len)
        who = VerifierIdentity.of_model(verifier, verifier_name, verifier_revision)
        indices = check_aux_indices(aux_indices or default_aux_indices(who.num_hidden_layers), who.num_hidden_layers)
        self.identity = SourceIdentity(who, tokenizer_fingerprint, tuple(indices), canonical_dtype(dtype))

    def check(self, lengths: Sequence[int]) -> int | None:
        return self.max_sample_tokens  # --max-model-len, as vLLM counts it (write.sample_token_limit); else any

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        for sample in samples:
            feats = capture_features(self.verifier, sample.input_ids, self.identity.aux_layer_indices)
            yield SampleFeatures(sample, feats["aux_hidden_states"], feats["last_hidden_state"],
                                 feats["verifier_greedy"])

    def report(self) -> dict[str, Any]:
        return {}


MEMORY_HINT = ("extract it with --engine vllm over the GPUs that hold it (--tensor-parallel-size; `eagle3-hf plan` "
               "sizes the engine), give it more memory (--device-map auto, --max-memory), or pass --offload-folder "
               "DIR to spill the rest to disk, read back at every forward")


@dataclass(frozen=True)
class TransformersOptions:
    """The transformers route's own options: a verifier already loaded (else it is loaded from the request's
    verifier with `load_kwargs`, from_pretrained's keywords: placement, dtype), the device to move it to (unless
    a device map placed it), --max-model-len, and the temporary offload folder made for --device-map (removed by
    `close`, once the features are written)."""

    model: PreTrainedModel | None = None
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    device: str | None = None
    max_model_len: int | None = None
    offload_tmp: tempfile.TemporaryDirectory[str] | None = None

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("--engine transformers (the verifier in this process)")
        add_placement_arguments(group, "0=70GiB,1=70GiB,cpu=200GiB")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TransformersOptions:
        """Placement first (a verifier its memory cannot hold is refused before a weight is read:
        verifier/memory.py), then the device: --device, else cuda:LOCAL_RANK or the CPU."""
        from ...verifier.memory import require_memory

        placed, offload_tmp = placement_kwargs(args)
        device = None
        if not args.device_map:
            device = args.device or (f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available()
                                     else "cpu")
        try:
            require_memory(args.verifier, args.revision, args.torch_dtype, placed.get("device_map"),
                           placed.get("max_memory"), device, args.offload_folder, MEMORY_HINT)
        except UsageError:
            if offload_tmp is not None:
                offload_tmp.cleanup()
            raise
        return cls(load_kwargs={"dtype": args.torch_dtype, **placed}, device=device,
                   max_model_len=args.max_model_len, offload_tmp=offload_tmp)

    def close(self) -> None:
        if self.offload_tmp is not None:
            self.offload_tmp.cleanup()


def open_source(request: SourceRequest) -> TransformersFeatures:
    """The table's opener (table.py): the verifier in this process."""
    from ...verifier.loading import load_verifier

    options = request.options if isinstance(request.options, TransformersOptions) else TransformersOptions()
    if request.target and request.target != request.verifier:  # train --features hf:VERIFIER
        raise UsageError(f"--features hf:{request.target} names another verifier than --verifier "
                         f"{request.verifier}: the teacher and the features must come from one verifier")
    verifier = options.model
    if verifier is None:
        verifier = load_verifier(request.verifier, revision=request.revision, **options.load_kwargs)
        placement = Counter(str(d) for d in (getattr(verifier, "hf_device_map", None) or {}).values())
        if placement:
            print(f"[extract] verifier placed on {dict(placement)} (module groups per device)", file=sys.stderr)
    if options.device is not None and not getattr(verifier, "hf_device_map", None):
        verifier.to(options.device)  # type: ignore[arg-type]  # functools.wraps on PreTrainedModel.to hides self
    return TransformersFeatures(verifier, request.tokenizer_fingerprint, request.aux_indices, request.dtype,
                                request.verifier or None, request.revision, options.max_model_len)


def named_verifier(target: str) -> tuple[str | None, str | None]:
    """`--features hf:NAME` names NAME (no revision); `hf` names none."""
    return (target or None), None


def extract_features(verifier: PreTrainedModel, tokenizer_fingerprint: str,
                     prepared_dataset: datasets.Dataset | str | Path, out_dir: str | Path, *,
                     aux_indices: Sequence[int] | None = None, dtype: str = "bfloat16",
                     verifier_name: str | None = None, store: StoreOptions | None = None,
                     progress: bool = True) -> ExtractionSummary:
    """Write features of a loaded verifier for `prepared_dataset` to `out_dir` (this rank's slice under torchrun);
    returns its summary. The Python face of `eagle3-hf extract`; for a revision, --max-model-len or explicit ranks,
    open `TransformersFeatures` and call `write.write_features` with it."""
    source = TransformersFeatures(verifier, tokenizer_fingerprint, aux_indices, dtype, verifier_name)
    prepared = PreparedDataset(prepared_dataset, "all", tokenizer_fingerprint=tokenizer_fingerprint)
    return write_features(source, prepared, out_dir, store=store, progress=progress)
