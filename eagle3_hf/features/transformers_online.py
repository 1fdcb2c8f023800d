"""Online mode: the frozen verifier produces each batch's features inside the training process.

Nothing is written, so it needs no terabyte of disk — at the price of one verifier forward per document per
step. Use it as `PackedDataset(PreparedDataset(...), max_seq_len)` + `OnlineFeatureCollator(verifier, ...)`:
the rows, and the batches they become, are those of offline mode (same split, same packing plan, same
per-document forward: bit-identical for whole documents; a truncated or split piece runs only tokens
[0, end), which a causal model cannot tell apart, so it matches to float rounding), so the two modes are
interchangeable and testable against each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from ..verifier.capture import capture_features
from ..verifier.family import check_aux_indices, default_aux_indices, text_config
from .packing import PackedCollator
from .quantize import as_stored
from .reader import select_split
from .records import canonical_dtype

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedModel


class PreparedDataset(Dataset[dict[str, Any]]):
    """Prepared samples (input_ids, loss_mask) with `.lengths`, split by sample id exactly like FeatureDataset."""

    def __init__(self, prepared: datasets.Dataset | str | Path, split: str = "train", validation_fraction: float = 0.05,
                 tokenizer_fingerprint: str | None = None) -> None:
        from ..data.prepared_format import open_prepared, prepared_lengths

        ds = open_prepared(prepared, tokenizer_fingerprint)
        ids = list(ds["id"])
        keep = select_split(ids, split, validation_fraction)
        all_lengths = prepared_lengths(ds)
        self._rows = ds.with_format("torch", columns=["input_ids", "loss_mask"])
        self._index = keep
        self.sample_ids = [ids[i] for i in keep]
        self.lengths = [int(all_lengths[i]) for i in keep]

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self._rows[self._index[index]]
        return {"input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"].bool(),
                "sample_id": self.sample_ids[index]}


class OnlineFeatureCollator:
    """Rows of a PackedDataset over prepared samples -> the same batch dict as offline, features computed now.

    Each document runs through the verifier on its own (a split piece with the tokens before it, as offline
    extraction saw them) so features never depend on packing. `storage_dtype` ("bfloat16", "float8_e4m3fn")
    rounds features as an offline shard would store them; None keeps the verifier's exact output. The batch
    is assembled on the CPU like an offline one; the trainer moves it to its device.
    """

    def __init__(self, verifier: PreTrainedModel, aux_indices: Sequence[int] | None = None,
                 max_seq_len: int | None = None, pad_token_id: int = 0,
                 storage_dtype: str | None = None) -> None:
        num_layers = text_config(verifier).num_hidden_layers
        self.verifier = verifier
        self.aux_indices = check_aux_indices(aux_indices or default_aux_indices(num_layers), num_layers)
        self.storage_dtype = canonical_dtype(storage_dtype) if storage_dtype else None
        self.collate = PackedCollator(pad_token_id=pad_token_id, max_seq_len=max_seq_len)

    @torch.no_grad()
    def features(self, row: dict[str, Any]) -> dict[str, Any]:
        """Add aux_hidden_states / last_hidden_state / verifier_greedy to one unpadded row."""
        aux: list[torch.Tensor] = []
        last: list[torch.Tensor] = []
        greedy: list[torch.Tensor] = []
        offset = 0
        prefixes = row.get("prefix_input_ids") or [None] * len(row["pieces"])
        for (_sid, start, end), prefix in zip(row["pieces"], prefixes):
            piece = row["input_ids"][offset : offset + end - start]
            offset += end - start
            ids = piece if prefix is None or prefix.numel() == 0 else torch.cat([prefix.long(), piece])
            f = capture_features(self.verifier, ids, self.aux_indices)
            h = f["last_hidden_state"].shape[-1]
            aux.append(as_stored(f["aux_hidden_states"][start:end], f["aux_hidden_states"].shape[-1] // h,
                                 self.storage_dtype))
            last.append(as_stored(f["last_hidden_state"][start:end], 1, self.storage_dtype))
            greedy.append(f["verifier_greedy"][start:end].long())
        out = dict(row)
        out.update(aux_hidden_states=torch.cat(aux).cpu(), last_hidden_state=torch.cat(last).cpu(),
                   verifier_greedy=torch.cat(greedy).cpu())
        return out

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.collate([self.features(r) for r in rows])
