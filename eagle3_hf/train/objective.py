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


def _block_terms(logits: torch.Tensor, renormalised: torch.Tensor,
                 mass: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log q, q, p on the draft vocabulary, α per row) of one block, in fp32."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    q = log_q.exp()
    p = renormalised if mass is None else renormalised * mass[:, None]
    return log_q, q, p, torch.minimum(p, q).sum(-1)


class AcceptanceLoss(torch.autograd.Function):
    """(Σ_k loss_k, Σ_k α_k) over rows k: student logits [N, Vd] at `student_rows`, the renormalised teacher [M, Vd]
    and its in-vocabulary mass [M] (None: the draft vocabulary is the whole vocabulary, m = 1) at `teacher_rows`.

    dα/dz_j = q_j (1[q_j < p_j] - Σ_{v: q_v < p_v} q_v) (min's subgradient, ties to p); the CE gradient is
    q ΣP - P. Both are recomputed in the backward a block of rows at a time; α's sum carries no gradient."""

    @staticmethod
    def forward(ctx: Any, student: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor | None,
                student_rows: torch.Tensor, teacher_rows: torch.Tensor, objective: Objective,
                block: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(student, probs, mass, student_rows, teacher_rows)
        ctx.objective, ctx.block = objective, block
        total = student.new_zeros((), dtype=torch.float32)
        alpha_total = student.new_zeros((), dtype=torch.float32)
        for s, t in row_blocks(student_rows, teacher_rows, block):
            renormalised = probs[t]
            log_q, _, _, alpha = _block_terms(student[s], renormalised, None if mass is None else mass[t])
            if objective.name == "lk-alpha":
                total -= alpha.clamp(min=ALPHA_FLOOR).log().sum()
            else:  # lk-hybrid
                w = torch.exp(-objective.eta * alpha)
                ce = -(renormalised * log_q).sum(-1)
                total += (w * ce + (1 - w) * (1 - alpha)).sum()
            alpha_total += alpha.sum()
        ctx.mark_non_differentiable(alpha_total)
        return total, alpha_total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, _grad_alpha: torch.Tensor | None
                 ) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        student, probs, mass, student_rows, teacher_rows = ctx.saved_tensors
        objective: Objective = ctx.objective
        grad = torch.zeros_like(student)
        for s, t in row_blocks(student_rows, teacher_rows, ctx.block):
            renormalised = probs[t]
            _, q, p, alpha = _block_terms(student[s], renormalised, None if mass is None else mass[t])
            below = q < p
            d_alpha = q * (below.float() - (q * below).sum(-1, keepdim=True))
            if objective.name == "lk-alpha":
                g = -d_alpha * torch.where(alpha > ALPHA_FLOOR, 1 / alpha.clamp(min=ALPHA_FLOOR), 0.0)[:, None]
            else:
                w = torch.exp(-objective.eta * alpha)[:, None]
                g = w * (q * renormalised.sum(-1, keepdim=True) - renormalised) - (1 - w) * d_alpha
            grad[s] = (g * grad_output).to(grad.dtype)
        return grad, None, None, None, None, None, None


@torch.no_grad()
def alpha_sum(student: torch.Tensor, probs: torch.Tensor, mass: torch.Tensor | None, student_rows: torch.Tensor,
              teacher_rows: torch.Tensor, block: int) -> torch.Tensor:
    """Σ_k α_k over the rows, with no loss and no gradient: the α metric of a run trained on another objective."""
    total = student.new_zeros((), dtype=torch.float32)
    for s, t in row_blocks(student_rows, teacher_rows, block):
        total += _block_terms(student[s], probs[t], None if mass is None else mass[t])[3].sum()
    return total
