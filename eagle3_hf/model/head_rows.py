"""Where the drafter's heads run during the TTT unroll, as row indices whose number the host already knows.

Selecting rows with a boolean mask (`hidden[mask]`) makes the host wait for the device to learn how many rows
there are; on a GPU that drains the launch queue at every step. `HeadRows` carries the same selection as flat
indices into [B * L], built from the masks and counts the host read once per batch (or, in the Trainer, once
per optimizer step for all its micro-batches: eagle3_hf.train.targets), so the unroll, the loss and the
metrics select rows without a synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def mask_rows(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat positions [count] (ascending) where `mask` is True; `count` is its number of True entries, known on
    the host, so the shape needs no read of the device."""
    return torch.nonzero_static(mask.reshape(-1), size=count).squeeze(1)


def read_masks(logits_mask: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per step, where step i *or a later one* reads the output: the MLP must run there (a position's step-i
    output feeds only its own later steps)."""
    read = list(logits_mask)
    for step in reversed(range(len(read) - 1)):
        read[step] = read[step] | read[step + 1]
    return read


def mask_counts(masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The number of True entries of each mask, one int64 tensor [len(masks)] on their device (no read)."""
    return torch.stack([m.sum() for m in masks])


@dataclass(frozen=True)
class HeadRows:
    """Per TTT step, the flat [B * L] positions whose logits are read (`logits`) and where the MLP runs
    (`mlp`), and where the teacher is read (`teacher`), with the masks they come from."""

    logits_mask: tuple[torch.Tensor, ...]  # per step, bool [B, L]
    teacher_mask: torch.Tensor | None  # bool [B, L]
    logits: tuple[torch.Tensor, ...]  # per step, [N_i]
    mlp: tuple[torch.Tensor, ...]  # per step, [R_i]
    teacher: torch.Tensor | None  # [M]

    @staticmethod
    def count_masks(logits_mask: Sequence[torch.Tensor], teacher_mask: torch.Tensor | None) -> list[torch.Tensor]:
        """The masks whose counts `from_masks` needs, in its order: logits per step, read per step, teacher."""
        return [*logits_mask, *read_masks(logits_mask), *([] if teacher_mask is None else [teacher_mask])]

    @classmethod
    def from_masks(cls, logits_mask: Sequence[torch.Tensor], teacher_mask: torch.Tensor | None,
                   counts: Sequence[int] | None = None) -> HeadRows:
        """`counts` as `count_masks` orders them; without them, read here (one host synchronisation)."""
        masks = cls.count_masks(logits_mask, teacher_mask)
        if counts is None:
            counts = mask_counts(masks).tolist()
        if len(counts) != len(masks):
            raise ValueError(f"{len(counts)} counts for {len(masks)} masks")
        rows = [mask_rows(m, int(c)) for m, c in zip(masks, counts)]
        steps = len(logits_mask)
        return cls(tuple(logits_mask), teacher_mask, tuple(rows[:steps]), tuple(rows[steps : 2 * steps]),
                   rows[2 * steps] if teacher_mask is not None else None)


def gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, L, ...] -> [N, ...] at flat positions `rows` (an index_select: its backward is an index_add)."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows)
