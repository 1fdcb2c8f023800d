"""The TTT loss — defined once; the Trainer, the metrics, the benches and gpu_check call it.

The targets it scores against (which position predicts what, where it counts) are `targets.step_targets`, whose
module docstring states the alignment; they are re-exported here. What it trains per row is the run's `Objective`
(objective.py: the soft cross-entropy by default, or an acceptance loss), through `acceptance_objective`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .objective import KL, AcceptanceLoss, Objective, alpha_sum
from .targets import PLAN_KEY, BatchPlan, StepTargets, batch_plan, count_loss_tokens, head_positions, step_targets

if TYPE_CHECKING:
    from ..model.head_rows import HeadRows
    from ..model.modeling_dflash import DFlashOutput
    from ..model.modeling_eagle3 import Eagle3Output

__all__ = ["PLAN_KEY", "BatchPlan", "DrafterLoss", "Objective", "StepTargets", "acceptance_objective",
           "count_loss_tokens", "drafter_loss", "head_positions", "soft_cross_entropy_at", "step_targets",
           "ttt_loss"]


LOSS_CHUNK_ELEMENTS = 1 << 23  # rows x draft vocab per block of the soft cross-entropy (32 MiB in fp32)


class _SoftCrossEntropy(torch.autograd.Function):
    """Σ_k CE(probs[teacher_rows[k]], student[student_rows[k]]) over student [N, Vd] and probs [M, Vd].

    Loss and gradient (softmax(student) Σp - p, the log-softmax backward) are computed a block of rows at a
    time, so no gathered, shifted or log-softmaxed copy of the logits ever exists: beyond the inputs, which
    the caller keeps anyway, the only full-size tensor is the gradient of the logits themselves."""

    @staticmethod
    def forward(ctx: Any, student: torch.Tensor, probs: torch.Tensor, student_rows: torch.Tensor,
                teacher_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(student, probs, student_rows, teacher_rows)
        total = student.new_zeros((), dtype=torch.float32)
        for s, t in _row_blocks(student_rows, teacher_rows, student.shape[-1]):
            total -= (probs[t] * F.log_softmax(student[s].float(), dim=-1)).sum()
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        student, probs, student_rows, teacher_rows = ctx.saved_tensors
        grad = torch.zeros_like(student)
        for s, t in _row_blocks(student_rows, teacher_rows, student.shape[-1]):
            p = probs[t]
            q = F.softmax(student[s].float(), dim=-1)
            grad[s] = ((q * p.sum(-1, keepdim=True) - p) * grad_output).to(grad.dtype)
        return grad, None, None, None


def _row_blocks(student_rows: torch.Tensor, teacher_rows: torch.Tensor,
                vocab: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    size = _block_rows(vocab)
    for start in range(0, student_rows.numel(), size):
        yield student_rows[start : start + size], teacher_rows[start : start + size]


def _block_rows(vocab: int) -> int:
    return max(1, LOSS_CHUNK_ELEMENTS // vocab)


def acceptance_objective(student: torch.Tensor, teacher: torch.Tensor, student_rows: torch.Tensor,
                         teacher_rows: torch.Tensor, in_vocab_mass: torch.Tensor | None,
                         objective: Objective) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Σ_k loss_k, Σ_k α_k or None) over rows k of the `objective` (objective.py), for any drafter's rows.

    student [N, Vd] logits on the draft vocabulary, read at `student_rows`; teacher [M, Vd] the verifier's
    distribution restricted to the draft vocabulary and renormalised (fp32), read at `teacher_rows`;
    in_vocab_mass [M] the verifier's mass on the draft vocabulary before renormalising (None: the draft vocabulary
    is the whole vocabulary). `kl` is the soft cross-entropy, bit for bit as before, with α only where a mass is
    given (a metric); the LK objectives need the mass wherever the draft vocabulary is a part of the verifier's.
    Computed a block of rows at a time: no [N, Vd] copy beyond the logits' gradient."""
    student, teacher = student.reshape(-1, student.shape[-1]), teacher.reshape(-1, teacher.shape[-1])
    mass = None if in_vocab_mass is None else in_vocab_mass.reshape(-1)
    block = _block_rows(student.shape[-1])
    if objective.name == "kl":
        # torch leaves autograd.Function.apply unannotated
        loss: torch.Tensor = _SoftCrossEntropy.apply(  # type: ignore[no-untyped-call]
            student, teacher, student_rows, teacher_rows)
        alphas = None if mass is None else alpha_sum(student, teacher, mass, student_rows, teacher_rows, block)
        return loss, alphas
    total, alphas = AcceptanceLoss.apply(  # type: ignore[no-untyped-call]
        student, teacher, mass, student_rows, teacher_rows, objective, block)
    return total, alphas


def _rows_of(positions: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """Flat [B * L] positions -> row numbers in a tensor that holds only the `kept` [B, L] positions."""
    if kept is None:
        return positions
    return (kept.flatten().cumsum(0) - 1)[positions]


def soft_cross_entropy_at(student_logits: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor,
                          shift: int, logits_mask: torch.Tensor | None = None,
                          teacher_mask: torch.Tensor | None = None,
                          positions: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over masked positions t of CE(teacher_probs[t + shift], student[t]) (`objective_at` with `kl`)."""
    return objective_at(student_logits, teacher_probs, mask, shift, logits_mask, teacher_mask, positions)[0]


def objective_at(student_logits: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor, shift: int,
                 logits_mask: torch.Tensor | None = None, teacher_mask: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, in_vocab_mass: torch.Tensor | None = None,
                 objective: Objective = KL) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(Σ over masked positions t of the objective's loss, the same sum of α or None) with the teacher at t + shift.

    student [B, L, Vd] (or its rows [N, Vd] at `logits_mask`), teacher_probs [B, L, Vd] (or its rows at
    `teacher_mask`; fp32, the teacher distribution shared by every TTT step) and its in-vocabulary mass [B, L] (or
    its rows), mask [B, L] (already guarantees t + shift is in t's document; inside both masks). `positions`: the
    mask's flat positions b * L + t (`BatchPlan.loss_rows`), so that no host synchronisation finds them."""
    flat = mask.flatten().nonzero().squeeze(1) if positions is None else positions  # b * L + t
    if flat.numel() == 0:
        zero = student_logits.sum() * 0.0
        return zero, None if in_vocab_mass is None else zero.detach()
    return acceptance_objective(student_logits, teacher_probs, _rows_of(flat, logits_mask),
                                _rows_of(flat + shift, teacher_mask), in_vocab_mass, objective)


@dataclass
class TTTLoss:
    """One batch's loss terms: Σ_i γ^i Σ_t loss_i(t), not yet normalised; per step (loss sum, loss tokens) and
    per step Σ_t α_i(t) over the same loss positions (None where the teacher gave no in-vocabulary mass)."""

    total: torch.Tensor
    step_losses: list[tuple[torch.Tensor, torch.Tensor]]
    step_alphas: list[torch.Tensor] | None


def ttt_loss(outputs: Eagle3Output, batch: dict[str, torch.Tensor], t2d: torch.Tensor, step_weight: float,
             plan: BatchPlan | None = None, objective: Objective = KL) -> TTTLoss:
    """One batch's TTT loss under `objective` (the soft cross-entropy by default). With the batch's `plan`, no
    host synchronisation."""
    teacher, mass = outputs.teacher_probs, outputs.teacher_in_vocab_mass
    assert outputs.logits is not None and teacher is not None  # a forward with a teacher attached
    if objective.needs_in_vocab_mass and mass is None:
        raise ValueError(f"objective {objective.name} needs the verifier's mass on the draft vocabulary: attach the "
                         "teacher with model.attach_teacher(verifier, in_vocab_mass=True)")
    total = outputs.logits[0].new_zeros(())
    step_losses, step_alphas = [], []
    for i, logits in enumerate(outputs.logits):
        mask = (step_targets(batch, i, t2d) if plan is None else plan.targets[i]).loss_mask
        step_loss, alphas = objective_at(logits, teacher, mask, i + 1,
                                         None if outputs.logits_mask is None else outputs.logits_mask[i],
                                         outputs.teacher_mask, None if plan is None else plan.loss_rows[i], mass,
                                         objective)
        total = total + (step_weight**i) * step_loss
        step_losses.append((step_loss.detach(), mask.sum()))
        if alphas is not None:
            step_alphas.append(alphas)
    return TTTLoss(total, step_losses, step_alphas if mass is not None else None)


@dataclass
class DrafterLoss:
    """One batch through the drafter: the unnormalised loss, what normalises it, and what the metrics read."""

    total: torch.Tensor | None  # Σ_i γ^i Σ_t CE_i(t) over the batch's loss positions (None without a teacher)
    loss_tokens: torch.Tensor  # step-0 loss positions of this batch (the Trainer's num_items_in_batch share)
    step_losses: list[tuple[torch.Tensor, torch.Tensor]] | None  # per step (loss sum, loss tokens)
    outputs: Eagle3Output | DFlashOutput  # the model's forward output
    logits_mask: tuple[torch.Tensor, ...] | None  # where each step's logits were computed (None: every position)
    head_rows: HeadRows | None = None  # the same as row indices (what StepStats.update reads without a sync)
    step_alphas: list[torch.Tensor] | None = None  # per step Σ α over its loss positions (with a teacher's mass)
    counts: torch.Tensor | None = None  # DFlash: the metric counts [8, B - 1] (`StepStats.add`), made with the loss

    def normalised(self, num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The loss the optimizer sees: `total` over the step-0 loss tokens of the whole optimizer step.

        `num_items_in_batch` is that global count (summed over gradient-accumulation batches and, with
        `average_tokens_across_devices`, over processes); without it, this batch's own count. Dividing every
        step's sum by the same step-0 count keeps the γ^i weights as the recipe states them, and makes the
        loss independent of packing and process count.
        """
        if self.total is None:
            raise ValueError("no teacher attached: the loss needs model.attach_teacher(verifier)")
        count = self.loss_tokens if num_items_in_batch is None else num_items_in_batch
        return self.total / torch.clamp(torch.as_tensor(count, device=self.total.device), min=1)


def drafter_loss(model: nn.Module, batch: dict[str, torch.Tensor], t2d: torch.Tensor, ttt_steps: int,
                 step_weight: float, feature_noise_std: float = 0.0, heads_where_read: bool = True,
                 objective: Objective = KL) -> DrafterLoss:
    """The training step's loss, defined once: the Trainer, the metrics and every bench call this, so a change
    to the loss is made here and a bench measures exactly the Trainer's step.

    `model` may be wrapped (DDP, DeepSpeed); `t2d` is the drafter's mask. `heads_where_read` computes the
    draft and teacher heads only at the positions the loss and the metrics read (`head_positions`), as row
    indices from the batch's plan (`targets.batch_plan`: the Trainer's, made once per optimizer step, or one
    made here with a single host synchronisation). `objective`: what each row trains (objective.py; default the
    soft cross-entropy).
    Divide `total` by the global loss-token count (`loss_tokens` summed over the batches of an optimizer step).
    """
    features = batch["aux_hidden_states"]
    if feature_noise_std > 0:  # in float32: half-precision features (packing.PackedCollator) would round the noise
        features = features.float() + torch.randn_like(features, dtype=torch.float32) * feature_noise_std
    plan = batch_plan(batch, ttt_steps, t2d) if heads_where_read else None
    head_rows = None if plan is None else plan.head_rows
    outputs = model(
        input_ids=batch["input_ids"],
        aux_hidden_states=features,
        position_ids=batch["position_ids"],
        document_ids=batch["document_ids"],
        last_hidden_state=batch["last_hidden_state"],
        ttt_steps=ttt_steps,
        head_rows=head_rows,
    )
    terms = None
    if outputs.teacher_probs is not None:
        terms = ttt_loss(outputs, batch, t2d, step_weight, plan, objective)
    loss_tokens = count_loss_tokens(batch, t2d) if plan is None else plan.targets[0].loss_mask.sum()
    if terms is None:
        return DrafterLoss(None, loss_tokens, None, outputs, None if head_rows is None else head_rows.logits_mask,
                           head_rows)
    return DrafterLoss(terms.total, loss_tokens, terms.step_losses, outputs,
                       None if head_rows is None else head_rows.logits_mask, head_rows, terms.step_alphas)
