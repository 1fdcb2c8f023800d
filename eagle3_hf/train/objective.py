"""Acceptance losses (LK losses, arXiv 2602.23881): train the drafter's acceptance rate directly.

Under speculative sampling a draft token drawn from q is accepted with probability α = Σ_v min(p_v, q_v) over
the verifier's *full* vocabulary, p being the verifier's distribution. The drafter's q lives on the draft
vocabulary (zero elsewhere), so the verifier's mass outside it can never be accepted: with the teacher P (p
restricted to the draft vocabulary and renormalised) and its in-vocabulary mass m = Σ_{v in draft} p_v, p = m·P on
the draft vocabulary and α = Σ_{v in draft} min(m·P_v, q_v). Renormalising (m = 1) would overstate α.

Per row (a position of a TTT step), with CE = -Σ P log q the soft cross-entropy the KL objective trains (the same
gradient as KL(P ‖ q)):

- `kl`: CE (the default; computed by `loss._SoftCrossEntropy`, unchanged);
- `lk-alpha`: -log α;
- `lk-hybrid`: w·CE + (1 - w)(1 - α) with w = exp(-η·sg(α)) (sg: no gradient through w): KL while the drafter
  is poor (α small, w near 1), the acceptance rate itself as it improves; η = 0 is `kl`, η → ∞ is 1 - α.

`AcceptanceLoss` computes the loss and its gradient a block of rows at a time, like the soft cross-entropy, so the
memory beyond the inputs is the logits' gradient plus a few blocks; it also returns Σ α over the rows (no gradient)
for the metrics. `loss.acceptance_objective` is the one entry point a drafter's loss calls.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

OBJECTIVES = ("kl", "lk-hybrid", "lk-alpha")
DEFAULT_LK_ETA = 3.0
ALPHA_FLOOR = 1e-12  # lk-alpha's -log α is taken at max(α, floor), with no gradient below it (a row q misses entirely)


@dataclass(frozen=True)
class Objective:
    """What the TTT loss trains per row: `name` one of OBJECTIVES, `eta` lk-hybrid's η."""

    name: str = "kl"
    eta: float = DEFAULT_LK_ETA

    def __post_init__(self) -> None:
        if self.name not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, not {self.name!r}")
        if not math.isfinite(self.eta) or self.eta < 0:
            raise ValueError(f"--lk-eta must be a finite number >= 0, not {self.eta}")

    @property
    def needs_in_vocab_mass(self) -> bool:
        """The LK objectives need the teacher's in-vocabulary mass (`attach_teacher(..., in_vocab_mass=True)`)."""
        return self.name != "kl"


KL = Objective()  # the default


def row_blocks(student_rows: torch.Tensor, teacher_rows: torch.Tensor,
               block: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, student_rows.numel(), block):
        yield student_rows[start : start + block], teacher_rows[start : start + block]


def _teacher_block(probs: torch.Tensor, mass: torch.Tensor | None,
                   t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, p) of one block: the renormalised teacher rows, the verifier's own probabilities on the draft vocabulary."""
    renormalised = probs[t]
    return renormalised, renormalised if mass is None else renormalised * mass[t][:, None]


class AcceptanceLoss(torch.autograd.Function):
    """(Σ_k loss_k, Σ_k α_k) over rows k: student logits [N, Vd] at `student_rows`, the renormalised teacher [M, Vd]
    and its in-vocabulary mass [M] (None: the draft vocabulary is the whole vocabulary, m = 1) at `teacher_rows`.

    dα/dz_j = q_j 1[q_j < p_j] - q_j S with S = Σ_{v: q_v < p_v} q_v (min's subgradient, ties to p); the CE gradient
    is q ΣP - P. The backward recomputes q a block of rows at a time and reads each row's α from the forward (one
    float per row); α's sum carries no gradient."""

    @staticmethod
    def forward(ctx: Any, student: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor | None,
                student_rows: torch.Tensor, teacher_rows: torch.Tensor, objective: Objective,
                block: int) -> tuple[torch.Tensor, torch.Tensor]:
        alphas = student.new_empty(student_rows.shape, dtype=torch.float32)  # per row, for the backward
        total = student.new_zeros((), dtype=torch.float32)
        for start in range(0, student_rows.numel(), block):
            s, t = student_rows[start : start + block], teacher_rows[start : start + block]
            renormalised, p = _teacher_block(probs, mass, t)
            logits = student[s].float()
            if objective.name == "lk-alpha":
                alpha = torch.minimum(F.softmax(logits, dim=-1), p).sum(-1)
                total -= alpha.clamp(min=ALPHA_FLOOR).log().sum()
            else:  # lk-hybrid
                log_q = F.log_softmax(logits, dim=-1)
                ce = -(renormalised * log_q).sum(-1)
                alpha = torch.minimum(log_q.exp_(), p).sum(-1)
                w = torch.exp(-objective.eta * alpha)
                total += (w * ce + (1 - w) * (1 - alpha)).sum()
            alphas[start : start + block] = alpha
        ctx.save_for_backward(student, probs, mass, student_rows, teacher_rows, alphas)
        ctx.objective, ctx.block = objective, block
        alpha_total = alphas.sum()
        ctx.mark_non_differentiable(alpha_total)
        return total, alpha_total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, _grad_alpha: torch.Tensor | None
                 ) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        student, probs, mass, student_rows, teacher_rows, alphas = ctx.saved_tensors
        objective: Objective = ctx.objective
        grad = torch.zeros_like(student)
        for start in range(0, student_rows.numel(), ctx.block):
            s, t = student_rows[start : start + ctx.block], teacher_rows[start : start + ctx.block]
            renormalised, p = _teacher_block(probs, mass, t)
            alpha = alphas[start : start + ctx.block, None]
            q = F.softmax(student[s].float(), dim=-1)
            q_below = torch.where(q < p, q, 0.0)  # q where min(p, q) = q: the terms α moves with
            below_mass = q_below.sum(-1, keepdim=True)  # S
            if objective.name == "lk-alpha":  # -dα/α = (q S - q 1[q < p]) / α
                scale = torch.where(alpha > ALPHA_FLOOR, 1 / alpha.clamp(min=ALPHA_FLOOR), 0.0)
                g = q.mul_(below_mass).sub_(q_below).mul_(scale)
            else:  # w (q ΣP - P) - (1 - w) dα = q (w ΣP + (1 - w) S) - w P - (1 - w) q 1[q < p]
                w = torch.exp(-objective.eta * alpha)
                g = q.mul_(w * renormalised.sum(-1, keepdim=True) + (1 - w) * below_mass)
                g.addcmul_(renormalised, w, value=-1.0).addcmul_(q_below, 1 - w, value=-1.0)
            grad[s] = g.mul_(grad_output).to(grad.dtype)
        return grad, None, None, None, None, None, None


@torch.no_grad()
def alpha_sum(student: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor | None, student_rows: torch.Tensor,
              teacher_rows: torch.Tensor, block: int) -> torch.Tensor:
    """Σ_k α_k over the rows, with no loss and no gradient: the α metric of a run trained on another objective."""
    total = student.new_zeros((), dtype=torch.float32)
    for s, t in row_blocks(student_rows, teacher_rows, block):
        total += torch.minimum(F.softmax(student[s].float(), dim=-1), _teacher_block(probs, mass, t)[1]).sum()
    return total
