"""The TTT targets of a batch, and the plan that says where the heads, the loss and the metrics read.

For step i the drafter's output at position t predicts token t + 2 + i (docs/contracts.md, TTT). Its teacher is the
verifier's distribution at position t + 1 + i (restricted to the draft vocabulary, renormalised), its
greedy reference is `verifier_greedy[t + 1 + i]`, and it counts only where token t + 2 + i is an
assistant token of the same document. Positions whose greedy token lies outside the draft vocabulary
carry no loss but count as misses in accuracy (such a token can never be accepted).

`BatchPlan` turns those masks into row indices whose counts the host has read once, so the unroll, the loss and
the metrics never make the host wait for the device; the Trainer plans every micro-batch of an optimizer step
with one read (`plan_batches`, from `_get_num_items_in_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..model.head_rows import HeadRows, mask_counts, mask_rows
from ..model.ttt_attention import shift_within_documents

PLAN_KEY = "ttt_plan"  # where the Trainer leaves a micro-batch's plan in the batch dict


@dataclass
class StepTargets:
    teacher_position_valid: torch.Tensor  # [B, L] bool: scored at this step (assistant, same document)
    greedy: torch.Tensor  # [B, L] long: the verifier's greedy token being predicted
    in_vocab: torch.Tensor  # [B, L] bool: greedy token is in the draft vocabulary
    shift: int  # teacher / greedy position = t + shift

    @property
    def loss_mask(self) -> torch.Tensor:
        return self.teacher_position_valid & self.in_vocab


def step_targets(batch: dict[str, torch.Tensor], step: int, t2d: torch.Tensor) -> StepTargets:
    """Where step `step` is scored and against what (see the module docstring)."""
    doc = batch["document_ids"]
    greedy, _ = shift_within_documents(batch["verifier_greedy"], doc, step + 1)
    assistant, valid = shift_within_documents(batch["loss_mask"].bool(), doc, step + 2)
    scored = assistant & valid
    return StepTargets(scored, greedy, t2d[greedy] & scored, step + 1)


def count_loss_tokens(batch: dict[str, torch.Tensor], t2d: torch.Tensor) -> torch.Tensor:
    """Step-0 loss positions: the Trainer's `num_items_in_batch`, so the loss doesn't depend on packing."""
    return step_targets(batch, 0, t2d.to(batch["verifier_greedy"].device)).loss_mask.sum()


def head_positions(batch: dict[str, torch.Tensor], steps: int,
                   t2d: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(per step, where its logits are read: scored positions; where the teacher is read: t + 1 + i for the
    loss positions t of step i). Passed to the forward as `logits_mask` / `teacher_mask`, they keep both
    heads off prompt tokens and document tails."""
    targets = [step_targets(batch, i, t2d) for i in range(steps)]
    return tuple(t.teacher_position_valid for t in targets), teacher_positions(targets)


def teacher_positions(targets: list[StepTargets]) -> torch.Tensor:
    """[B, L] bool: t + 1 + i for the loss positions t of every step i (where the teacher is read)."""
    teacher_mask = torch.zeros_like(targets[0].teacher_position_valid)
    for i, t in enumerate(targets):
        teacher_mask[:, i + 1 :] |= t.loss_mask[:, : -(i + 1)]
    return teacher_mask


@dataclass
class BatchPlan:
    """One batch's targets per step, where the heads run (`head_rows`) and where each step's loss counts
    (`loss_rows`, flat positions into [B * L]), with every count known on the host."""

    steps: int
    targets: list[StepTargets]
    head_rows: HeadRows
    loss_rows: tuple[torch.Tensor, ...]  # per step [C_i]
    loss_counts: list[int]  # per step C_i; C_0 is the batch's share of num_items_in_batch


class _PendingPlan:
    """A plan's masks and the count tensor [3 x steps + 1] that `resolve` turns into a `BatchPlan`."""

    def __init__(self, batch: dict[str, torch.Tensor], steps: int, t2d: torch.Tensor):
        t2d = t2d.to(batch["verifier_greedy"].device)
        self.steps = steps
        self.targets = [step_targets(batch, i, t2d) for i in range(steps)]
        self.logits_mask = tuple(t.teacher_position_valid for t in self.targets)
        self.teacher_mask = teacher_positions(self.targets)
        self.loss_masks = [t.loss_mask for t in self.targets]
        self.counts = mask_counts([*HeadRows.count_masks(self.logits_mask, self.teacher_mask), *self.loss_masks])

    def resolve(self, counts: list[int]) -> BatchPlan:
        heads = len(counts) - self.steps
        head_rows = HeadRows.from_masks(self.logits_mask, self.teacher_mask, counts[:heads])
        loss_counts = counts[heads:]
        loss_rows = tuple(mask_rows(m, c) for m, c in zip(self.loss_masks, loss_counts))
        return BatchPlan(self.steps, self.targets, head_rows, loss_rows, loss_counts)


def plan_batches(batches: list[dict[str, torch.Tensor]], steps: int, t2d: torch.Tensor) -> list[BatchPlan]:
    """Plans for several batches with one read of the device for all of them (the counts)."""
    pending = [_PendingPlan(batch, steps, t2d) for batch in batches]
    if not pending:
        return []
    counts = torch.cat([p.counts for p in pending]).tolist()  # the one host synchronisation
    per = len(counts) // len(pending)
    return [p.resolve(counts[k * per : (k + 1) * per]) for k, p in enumerate(pending)]


def batch_plan(batch: dict[str, Any], steps: int, t2d: torch.Tensor) -> BatchPlan:
    """The plan the Trainer left in the batch (`PLAN_KEY`), or one made here (one host synchronisation)."""
    plan = batch.get(PLAN_KEY)
    if isinstance(plan, BatchPlan) and plan.steps == steps:
        return plan
    return plan_batches([batch], steps, t2d)[0]
