"""Packing feature samples into the trainer's rows: a deterministic plan and the batch collator.

PackedDataset plans rows from lengths alone (first-fit-decreasing) and PackedCollator turns rows into the
[B, L] batch the trainer consumes: per-document position ids, document ids, nothing mixed, nothing lost.
Stored features (memory-mapped views from `reader.FeatureDataset`) are decoded straight into the batch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset, get_worker_info

from ..constants import PAD_DOCUMENT
from .reader import FeatureDataset, StoredFeatures


class SampleSource(Protocol):
    """What `PackedDataset` packs: samples with their token counts (reader.FeatureDataset,
    data.prepared_samples.PreparedDataset)."""

    @property
    def lengths(self) -> Sequence[int]: ...

    def __getitem__(self, index: int) -> dict[str, Any]: ...


def _first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of item indices; items placed largest first into the lowest-numbered bin with room.

    A max segment tree over remaining capacity finds that bin in O(log n); unopened bins start full, so the
    leftmost bin with room is either an open one or the next new one.
    """
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    n = max(1, len(sizes))
    size = 1
    while size < n:
        size *= 2
    tree = [0] * (2 * size)
    for leaf in range(n):
        tree[size + leaf] = capacity
    for node in range(size - 1, 0, -1):
        tree[node] = max(tree[2 * node], tree[2 * node + 1])
    bins: list[list[int]] = []
    for item in order:
        need, node = sizes[item], 1
        while node < size:
            node = 2 * node if tree[2 * node] >= need else 2 * node + 1
        leaf = node - size
        if leaf == len(bins):
            bins.append([])
        bins[leaf].append(item)
        tree[node] -= need
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


class PackedDataset(Dataset[dict[str, Any]]):
    """Rows of at most `max_seq_len` tokens, each a list of (sample index, start, end) pieces.

    The plan depends only on `dataset.lengths`, `max_seq_len`, `packing`, `overlong` and `seed`, so every
    rank and every run builds the same rows. overlong: "truncate" keeps the first max_seq_len tokens, "split"
    cuts a sample into max_seq_len pieces (each its own document), "error" refuses; counts go to `.stats`.
    `seed` shuffles the order of rows (None keeps first-fit order).
    """

    def __init__(self, dataset: SampleSource, max_seq_len: int, packing: bool = True, overlong: str = "truncate",
                 seed: int | None = 0) -> None:
        if overlong not in ("truncate", "split", "error"):
            raise ValueError(f"overlong must be 'truncate', 'split' or 'error', got {overlong!r}")
        if max_seq_len < 1:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.dataset, self.max_seq_len = dataset, max_seq_len
        lengths = list(dataset.lengths)
        ids = getattr(dataset, "sample_ids", None)
        stats: dict[str, float] = {"samples": len(lengths), "empty": 0, "truncated": 0, "truncated_tokens": 0,
                                   "split": 0}
        pieces: list[tuple[int, int, int]] = []
        for i, n in enumerate(lengths):
            if n == 0:
                stats["empty"] += 1
            elif n <= max_seq_len:
                pieces.append((i, 0, n))
            elif overlong == "error":
                name = ids[i] if ids is not None else f"#{i}"
                raise ValueError(f"sample {name!r} has {n} tokens > max_seq_len {max_seq_len} "
                                 f"(choose overlong='truncate' or 'split')")
            elif overlong == "truncate":
                pieces.append((i, 0, max_seq_len))
                stats["truncated"] += 1
                stats["truncated_tokens"] += n - max_seq_len
            else:
                pieces.extend((i, s, min(s + max_seq_len, n)) for s in range(0, n, max_seq_len))
                stats["split"] += 1
        if packing:
            bins = _first_fit_decreasing([e - s for _, s, e in pieces], max_seq_len)
            # inside a row keep dataset order, so a row reads its shards front to back
            self.rows = [sorted(pieces[j] for j in b) for b in bins]
        else:
            self.rows = [[p] for p in pieces]
        if seed is not None:
            random.Random(seed).shuffle(self.rows)
        tokens = sum(e - s for _, s, e in pieces)
        stats.update(rows=len(self.rows), tokens=tokens,
                     fill=round(tokens / (len(self.rows) * max_seq_len), 4) if self.rows else 0.0)
        self.stats = stats

    def __len__(self) -> int:
        return len(self.rows)

    def _piece(self, i: int, start: int, end: int) -> dict[str, Any]:
        if isinstance(self.dataset, FeatureDataset):
            return self.dataset.get(i, start, end, decode=False)
        if hasattr(self.dataset, "get"):
            piece: dict[str, Any] = self.dataset.get(i, start, end)
            return piece
        item = self.dataset[i]
        n = len(item["input_ids"])
        return {k: (v[start:end] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == n else v)
                for k, v in item.items()}

    def __getitem__(self, r: int) -> dict[str, Any]:
        """One row, unpadded: per-token tensors concatenated over its documents, plus document bookkeeping.

        Features of a FeatureDataset stay StoredFeatures (views) until the collator decodes them.
        """
        parts: list[dict[str, Any]] = []
        position_ids: list[torch.Tensor] = []
        document_ids: list[torch.Tensor] = []
        pieces: list[tuple[str, int, int]] = []  # (sample id, start, end)
        shards: list[str | None] = []
        for d, (i, s, e) in enumerate(self.rows[r]):
            item = self._piece(i, s, e)
            parts.append(item)
            position_ids.append(torch.arange(e - s))
            document_ids.append(torch.full((e - s,), d, dtype=torch.long))
            pieces.append((item.get("sample_id", str(i)), s, e))
            shards.append(item.get("shard"))
        row: dict[str, Any] = {}
        for k, v in parts[0].items():
            if torch.is_tensor(v):
                row[k] = torch.cat([p[k] for p in parts])
            elif isinstance(v, StoredFeatures):
                row[k] = StoredFeatures([piece for p in parts for piece in p[k].pieces])
        row.update(position_ids=torch.cat(position_ids), document_ids=torch.cat(document_ids), pieces=pieces,
                   shards=shards, max_seq_len=self.max_seq_len)
        return row


def pack_splits(train: SampleSource, evals: SampleSource, max_seq_len: int, packing: bool = True,
                overlong: str = "truncate") -> tuple[PackedDataset, PackedDataset]:
    """The training and validation splits packed by one plan, the same for every route of `train --features`."""
    return (PackedDataset(train, max_seq_len, packing=packing, overlong=overlong),
            PackedDataset(evals, max_seq_len, packing=packing, overlong=overlong))


class PackedCollator:
    """Rows -> one batch of [B, L] tensors, L = max_seq_len, padded (document_ids -1, loss_mask False).

    Features stored in bf16 (or fp16) stay in that dtype in the batch: half the bytes of float32 to copy to the
    device, where the drafter upcasts them (its fc and the teacher's head cast their inputs), with the same values
    a float32 batch would hold. fp8 features (values times a float32 scale) are decoded to float32 here.
    """

    def __init__(self, pad_token_id: int = 0, max_seq_len: int | None = None,
                 keep_storage_dtype: bool = True) -> None:
        self.pad_token_id, self.max_seq_len = pad_token_id, max_seq_len
        self.keep_storage_dtype = keep_storage_dtype

    def _dtype(self, rows: list[dict[str, Any]], key: str) -> torch.dtype:
        """The batch dtype of a feature: the stored half-precision dtype when every piece has it, else float32."""
        if not self.keep_storage_dtype:
            return torch.float32
        dtypes: set[torch.dtype] = set()
        for row in rows:
            value = row[key]
            if isinstance(value, StoredFeatures):
                dtypes |= {torch.float32 if scale is not None else q.dtype for q, scale in value.pieces}
            else:
                dtypes.add(value.dtype)
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        L: int = self.max_seq_len or rows[0]["max_seq_len"]
        B = len(rows)
        aux_dim = rows[0]["aux_hidden_states"].shape[-1]
        hidden = rows[0]["last_hidden_state"].shape[-1]
        batch = {
            "input_ids": torch.full((B, L), self.pad_token_id, dtype=torch.long),
            "aux_hidden_states": _empty((B, L, aux_dim), self._dtype(rows, "aux_hidden_states")),  # [B, L, 3H]
            "last_hidden_state": _empty((B, L, hidden), self._dtype(rows, "last_hidden_state")),  # [B, L, H]
            "verifier_greedy": torch.full((B, L), self.pad_token_id, dtype=torch.long),
            "loss_mask": torch.zeros(B, L, dtype=torch.bool),
            "position_ids": torch.zeros(B, L, dtype=torch.long),
            "document_ids": torch.full((B, L), PAD_DOCUMENT, dtype=torch.long),
        }
        for b, row in enumerate(rows):
            n = row["input_ids"].shape[0]
            if n > L:
                raise ValueError(f"row {b} has {n} tokens > max_seq_len {L}")
            for key, out in batch.items():
                value = row[key]
                if isinstance(value, StoredFeatures):
                    value.decode_into(out[b, :n])
                else:
                    out[b, :n] = value
                if key in ("aux_hidden_states", "last_hidden_state"):
                    out[b, n:] = 0  # padding (the buffers are not pre-zeroed: one write pass per byte)
        for key in ("aux_hidden_states", "last_hidden_state"):
            refuse_non_finite(batch[key], rows, key)
        return batch


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised buffer; in a DataLoader worker, in shared memory from the start (as torch's default collate
    does), so handing the batch to the training process copies none of its bytes again."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    # torch leaves Tensor._typed_storage unannotated
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(math.prod(shape))  # type: ignore[no-untyped-call]
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


def refuse_non_finite(features: torch.Tensor, rows: list[dict[str, Any]], key: str) -> None:
    """Name the sample and shard of a NaN/Inf feature before it trains: its checksum can be valid (a faulty
    extraction or import wrote it), and one NaN makes every weight NaN at the next step.

    The fast path is one reduction over the batch (a sum is finite when every term is); only a non-finite
    sum, or an overflowing one, pays for the per-element search.
    """
    if bool(torch.isfinite(features.sum())):
        return
    for b, row in enumerate(rows):
        bad = ~torch.isfinite(features[b]).all(dim=-1)  # [L]
        if not bool(bad.any()):
            continue
        token = int(bad.nonzero()[0])
        start = 0
        pieces = row.get("pieces") or [(f"row {b}", 0, features.shape[1])]
        shards = row.get("shards") or [None] * len(pieces)
        for (sample_id, s, e), shard in zip(pieces, shards):
            if token < start + e - s:
                where = f"in shard {shard}" if shard else "from the verifier (online)"
                raise ValueError(f"sample {sample_id!r} {where} has NaN/Inf in {key} (token {s + token - start}); "
                                 "re-extract it or remove it from the manifest")
            start += e - s
