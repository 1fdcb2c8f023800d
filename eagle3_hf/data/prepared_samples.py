"""Prepared samples as training and extraction read them: the split by sample id, and `PreparedDataset`, the one
reader of a prepared directory's samples, for the online routes (`train --features hf` / `http://...`) and for the
offline write loop (features/write.py's `write_features`), which hands a route `PreparedSample`s.

The split is the feature directory's too (reader.FeatureDataset calls `select_split`), so a sample lands in the same
split whether its features were written to disk or are computed while training.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase


@dataclass
class PreparedSample:
    """One prepared sample, as a feature route reads it."""

    sample_id: str
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T]


def in_validation(sample_id: str, validation_fraction: float) -> bool:
    """Stable split: the first 8 bytes of sha256(id) as a fraction of 2^64, independent of order and machine."""
    h = int.from_bytes(hashlib.sha256(sample_id.encode("utf-8")).digest()[:8], "big")
    return h < validation_fraction * 2.0**64


def select_split(ids: list[str], split: str, validation_fraction: float) -> list[int]:
    """The positions of `ids` in `split` ("train", "validation" or "all")."""
    if split not in ("train", "validation", "all"):
        raise ValueError(f"split must be 'train', 'validation' or 'all', got {split!r}")
    if split == "all":
        return list(range(len(ids)))
    want_val = split == "validation"
    return [i for i, sid in enumerate(ids) if in_validation(sid, validation_fraction) == want_val]


class PreparedDataset(Dataset[dict[str, Any]]):
    """Prepared samples (input_ids, loss_mask, sample_id) with `.lengths`, split by sample id exactly like
    FeatureDataset; `position(sample_id)` finds a sample of the split by its id.

    Opened with the verifier's `tokenizer` (or its `tokenizer_fingerprint`), a directory another tokenizer (or
    another tokenizer class) prepared is refused here, before any model loads; `tokenizer_fingerprint` then says
    which tokenizer the samples were checked against (a `datasets.Dataset` given as itself has no record to check:
    the caller's word), which the feature write loop requires of them."""

    def __init__(self, prepared: datasets.Dataset | str | Path, split: str = "train", validation_fraction: float = 0.05,
                 tokenizer_fingerprint: str | None = None, *, tokenizer: PreTrainedTokenizerBase | None = None
                 ) -> None:
        from .prepared_format import load_prepared, open_prepared, prepared_lengths

        if tokenizer is not None and tokenizer_fingerprint is None:
            from .fingerprint import tokenizer_fingerprint as fingerprint_of

            tokenizer_fingerprint = fingerprint_of(tokenizer)
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.meta: dict[str, Any] = {}  # a directory's prepare meta (tokenizer, counts); {} for a Dataset object
        self.path = Path(prepared) if isinstance(prepared, (str, Path)) else None
        if isinstance(prepared, (str, Path)):
            ds, self.meta = load_prepared(prepared, tokenizer_fingerprint, tokenizer)
        else:
            ds = open_prepared(prepared)
        self._rows = ds.with_format("torch", columns=["input_ids", "loss_mask"])
        self._index = list(range(len(ds)))
        self.sample_ids: list[str] = list(ds["id"])
        self.lengths = [int(n) for n in prepared_lengths(ds)]
        self._keep(split, validation_fraction)

    def select(self, split: str, validation_fraction: float = 0.05) -> PreparedDataset:
        """`split` of these samples, sharing the opened dataset: a directory opened once (split "all") gives the
        collator's samples and both training splits."""
        part = copy.copy(self)
        part._keep(split, validation_fraction)
        return part

    def _keep(self, split: str, validation_fraction: float) -> None:
        keep = select_split(self.sample_ids, split, validation_fraction)
        self._index = [self._index[i] for i in keep]
        self.sample_ids = [self.sample_ids[i] for i in keep]
        self.lengths = [self.lengths[i] for i in keep]
        self._position = {sid: i for i, sid in enumerate(self.sample_ids)}

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self._rows[self._index[index]]
        return {"input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"].bool(),
                "sample_id": self.sample_ids[index]}

    def sample(self, index: int) -> PreparedSample:
        """Sample `index` of this split, as a feature route reads it."""
        row = self[index]
        return PreparedSample(row["sample_id"], row["input_ids"], row["loss_mask"])

    def samples(self, indices: Sequence[int]) -> Sequence[PreparedSample]:
        """Samples `indices` of this split, each read when asked for (a route may hold only a few at a time)."""
        return _Samples(self, list(indices))

    def tokenizer_record(self) -> dict[str, Any]:
        """The class (and --trust-remote-code) of the tokenizer that prepared these samples; {} where unrecorded."""
        from .fingerprint import recorded_tokenizer

        return recorded_tokenizer(self.meta)

    def position(self, sample_id: str) -> int:
        """The index of `sample_id` in this split; KeyError naming it when the split does not hold it."""
        try:
            return self._position[sample_id]
        except KeyError:
            raise KeyError(f"sample {sample_id!r} is not in this prepared split") from None


class _Samples(Sequence[PreparedSample]):
    """`PreparedDataset.samples`: a lazy view, no slices."""

    def __init__(self, prepared: PreparedDataset, indices: list[int]) -> None:
        self.prepared, self.indices = prepared, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> PreparedSample:  # type: ignore[override]  # no slices
        return self.prepared.sample(self.indices[k])
