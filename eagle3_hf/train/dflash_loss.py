"""The DFlash training step: where the blocks go (anchors), what each block position is scored against, the loss
and the per-position counts the metrics read. The counterpart of loss.py / targets.py for the block drafter.

A block anchored at position a of a document (the anchor is the data token there) predicts, at block position
k = 1 .. B - 1, the token at a + k. Its teacher is the verifier's distribution at a + k - 1 (the softmax of its
lm_head over its final state there, full vocabulary: the drafter shares it) and its greedy reference
`verifier_greedy[a + k - 1]`; it counts where a + k is an assistant token of the same document. Anchors are drawn
on assistant tokens where position 1 counts and the anchor has context (as SpecForge's DFlash training samples
them inside the loss mask; at decoding time every anchor is a generated token), at most `anchors_per_row`
per packed row, uniformly without replacement. Position k's loss is weighted exp(-(k - 1) / decay)
(`DFlashConfig.block_loss_decay`), i.e. gamma^(k - 1) with gamma = exp(-1 / decay), and the sum is normalised by
the anchors of the whole optimizer step (the Trainer's `num_items_in_batch`), as the TTT loss by its step-0 tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .loss import DrafterLoss, acceptance_objective
from .objective import KL, Objective

ANCHORS_KEY = "dflash_anchors"  # where the Trainer leaves a micro-batch's anchors in the batch dict
DEFAULT_ANCHORS_PER_ROW = 64


def anchor_candidates(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[B, L] bool: assistant positions a >= 1 of a document whose next token is an assistant token of it too. At
    decoding time every anchor is a generated token (the first is the verifier's answer to the prompt), so an
    anchor on a prompt token would train a block the engine never drafts."""
    doc, pos, assistant = batch["document_ids"], batch["position_ids"], batch["loss_mask"].bool()
    nxt = torch.zeros_like(doc, dtype=torch.bool)
    nxt[:, :-1] = (doc[:, 1:] == doc[:, :-1]) & assistant[:, 1:]
    return nxt & assistant & (doc >= 0) & (pos >= 1)


def sample_anchors(batch: dict[str, torch.Tensor], anchors_per_row: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """[B, A] anchor positions, ascending per row, -1 where a row has fewer candidates than A."""
    candidates = anchor_candidates(batch)
    count = int(candidates.sum(1).max().item()) if candidates.numel() else 0
    width = max(1, min(anchors_per_row, count))
    scores = torch.rand(candidates.shape, generator=generator, device="cpu").to(candidates.device)
    scores = scores.masked_fill(~candidates, -1.0)
    top, idx = scores.topk(width, dim=1)
    anchors = torch.where(top >= 0, idx, torch.full_like(idx, -1))
    # ascending, -1 last
    key = torch.where(anchors >= 0, anchors, torch.full_like(anchors, candidates.shape[1]))
    return anchors.gather(1, key.argsort(dim=1))


def ensure_anchors(batch: dict[str, Any], anchors_per_row: int) -> torch.Tensor:
    """The anchors the Trainer left in the batch, or new ones."""
    anchors = batch.get(ANCHORS_KEY)
    if not isinstance(anchors, torch.Tensor):
        anchors = sample_anchors(batch, anchors_per_row)
        batch[ANCHORS_KEY] = anchors
    return anchors


def block_targets(batch: dict[str, torch.Tensor], anchors: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy [N, B - 1], scored [N, B - 1]) for the N valid anchors, row-major (the model's logits order)."""
    doc = batch["document_ids"]
    length = doc.shape[1]
    valid = anchors >= 0
    at = anchors.clamp(min=0)
    k = torch.arange(1, block_size, device=doc.device)
    target = at[:, :, None] + k  # [B, A, S - 1]
    inside = target < length
    t = target.clamp(max=length - 1).view(doc.shape[0], -1)
    same_doc = doc.gather(1, t).view_as(target) == doc.gather(1, at)[:, :, None]
    assistant = batch["loss_mask"].bool().gather(1, t).view_as(target)
    greedy = batch["verifier_greedy"].long().gather(1, (t - 1).clamp(min=0)).view_as(target)
    scored = inside & same_doc & assistant & valid[:, :, None]
    return greedy[valid], scored[valid]


def objective_per_position(logits: torch.Tensor, teacher: torch.Tensor, scored: torch.Tensor,
                           objective: Objective = KL) -> tuple[torch.Tensor, torch.Tensor]:
    """([S - 1] Σ over scored anchors of the objective's loss, [S - 1] Σ of α) per block position, logits and
    teacher [N, S - 1, V]. The EAGLE-3 loss's blockwise per-row objective (`loss.acceptance_objective`): no
    log-softmaxed or gathered copy of the [N, S - 1, V] logits is made, which matters at a full vocabulary. The
    drafter's vocabulary is the verifier's whole one, so the teacher's mass on it is 1 and α is exact."""
    vocab = logits.shape[-1]
    flat_logits, flat_teacher = logits.reshape(-1, vocab), teacher.reshape(-1, vocab)
    mass = flat_teacher.new_ones(flat_teacher.shape[0])
    rows = torch.arange(scored.numel(), device=scored.device).view_as(scored)  # row n * (S - 1) + k
    losses, alphas = [], []
    for k in range(scored.shape[1]):
        at = rows[:, k][scored[:, k]]  # a host read per position: the anchors' count is known on the host anyway
        if at.numel() == 0:
            losses.append(flat_logits.sum() * 0.0)
            alphas.append(flat_teacher.new_zeros(()))
            continue
        loss, alpha = acceptance_objective(flat_logits, flat_teacher, at, at, mass, objective)
        losses.append(loss)
        alphas.append(flat_teacher.new_zeros(()) if alpha is None else alpha.detach())
    return torch.stack(losses), torch.stack(alphas)


def position_weights(block_size: int, decay: float, device: torch.device | None = None) -> torch.Tensor:
    """exp(-(k - 1) / decay) for k = 1 .. B - 1."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32, device=device) / decay)


def step_weight(decay: float) -> float:
    """The geometric ratio of `position_weights`: what `StepStats.weighted_loss` takes."""
    return math.exp(-1.0 / decay)


def block_counts(logits: torch.Tensor, greedy: torch.Tensor, scored: torch.Tensor,
                 position_losses: torch.Tensor | None, position_alphas: torch.Tensor | None = None) -> torch.Tensor:
    """[8, B - 1] float64, `StepStats`' fields per block position: scored, right, cond scored, cond right, loss
    sum, loss tokens, α sum, α rows. Position k is right when the draft argmax equals the verifier's greedy token;
    conditional counts need positions 1 .. k - 1 right at that anchor."""
    right = (logits.argmax(-1) == greedy) & scored  # [N, S - 1]
    before = torch.ones_like(right)
    before[:, 1:] = right.cumprod(dim=1)[:, :-1].bool()
    cond = scored & before
    zero = torch.zeros(scored.shape[1], dtype=torch.float64, device=scored.device)
    losses = zero if position_losses is None else position_losses.double()
    alphas = zero if position_alphas is None else position_alphas.double()
    alpha_rows = zero if position_alphas is None else scored.sum(0).double()
    return torch.stack([scored.sum(0).double(), right.sum(0).double(), cond.sum(0).double(),
                        (right & cond).sum(0).double(), losses, scored.sum(0).double(), alphas, alpha_rows])


def dflash_loss(model: nn.Module, batch: dict[str, Any], anchors_per_row: int = DEFAULT_ANCHORS_PER_ROW,
                feature_noise_std: float = 0.0, objective: Objective = KL) -> DrafterLoss:
    """One batch through a DFlash drafter (possibly wrapped): Σ_k w_k Σ_anchors CE(teacher, draft) unnormalised,
    the anchor count that normalises it, and per block position (loss sum, scored tokens) and the metric counts
    (`DrafterLoss.counts`)."""
    drafter: Any = getattr(model, "module", model)
    config = drafter.config
    size = int(config.block_size)
    anchors = ensure_anchors(batch, anchors_per_row)
    features = batch["aux_hidden_states"]
    if feature_noise_std > 0:
        features = features.float() + torch.randn_like(features, dtype=torch.float32) * feature_noise_std
    outputs = model(input_ids=batch["input_ids"], aux_hidden_states=features, anchors=anchors,
                    position_ids=batch["position_ids"], document_ids=batch["document_ids"],
                    last_hidden_state=batch["last_hidden_state"])
    greedy, scored = block_targets(batch, anchors, size)
    logits = outputs.logits  # [N, S - 1, V]
    total = per_position = per_alpha = None
    if outputs.teacher_probs is not None:
        per_position, per_alpha = objective_per_position(logits, outputs.teacher_probs, scored, objective)  # [S - 1]
        total = (per_position * position_weights(size, float(config.block_loss_decay), per_position.device)).sum()
    anchors_count = (anchors >= 0).sum()
    step_losses = None if per_position is None else [(per_position[k].detach(), scored[:, k].sum())
                                                     for k in range(size - 1)]
    result = DrafterLoss(total, anchors_count, step_losses, outputs, None)
    result.counts = block_counts(logits.detach(), greedy, scored,
                                 None if per_position is None else per_position.detach(), per_alpha)
    return result
