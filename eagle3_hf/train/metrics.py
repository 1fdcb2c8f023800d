"""Per-step metrics of a drafter — accuracy, conditional accuracy, simulated τ — shared by the trainer,
evaluation and diff. They score against the loss's targets (`loss.step_targets`, whose module docstring states
the alignment); a position whose greedy token lies outside the draft vocabulary counts as a miss, since such a
token can never be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..model.checkpoint import draft_to_target
from .loss import drafter_loss, step_targets

if TYPE_CHECKING:
    from ..features.packing import SampleSource
    from ..model.modeling_eagle3 import Eagle3DraftModel


@dataclass
class StepStats:
    """Counts accumulated over batches (and reduced over processes) -> accuracy, conditional accuracy, τ."""

    steps: int
    scored: list = field(default_factory=list)
    correct: list = field(default_factory=list)
    cond_scored: list = field(default_factory=list)
    cond_correct: list = field(default_factory=list)
    loss_sum: list = field(default_factory=list)
    loss_tokens: list = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("scored", "correct", "cond_scored", "cond_correct", "loss_sum", "loss_tokens"):
            setattr(self, name, [0.0] * self.steps)

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.tensor([self.scored, self.correct, self.cond_scored, self.cond_correct, self.loss_sum,
                             self.loss_tokens], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepStats:
        stats = cls(t.shape[1])
        rows = t.double().cpu().tolist()
        stats.scored, stats.correct, stats.cond_scored, stats.cond_correct, stats.loss_sum, stats.loss_tokens = rows
        return stats

    @torch.no_grad()
    def update(self, logits: tuple[torch.Tensor, ...], batch: dict, d2t: torch.Tensor, t2d: torch.Tensor,
               step_losses: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               logits_mask: tuple[torch.Tensor, ...] | None = None) -> None:
        """Add one batch. A position is 'right' at step i when the draft argmax, mapped to a verifier id,
        equals the verifier's greedy token; the conditional count needs steps 0..i-1 right at that anchor."""
        all_right = None
        for i in range(self.steps):
            targets = step_targets(batch, i, t2d)
            if logits_mask is None:
                draft = logits[i].argmax(dim=-1)
            else:  # rows at logits_mask[i], which holds every scored position
                draft = torch.zeros_like(targets.greedy)
                draft[logits_mask[i]] = logits[i].argmax(dim=-1)
            right = (draft_to_target(d2t, draft) == targets.greedy) & targets.teacher_position_valid
            scored = targets.teacher_position_valid
            self.scored[i] += float(scored.sum())
            self.correct[i] += float(right.sum())
            cond = scored if all_right is None else scored & all_right
            self.cond_scored[i] += float(cond.sum())
            self.cond_correct[i] += float((right & cond).sum())
            all_right = right if all_right is None else all_right & right
            if step_losses is not None:
                self.loss_sum[i] += float(step_losses[i][0])
                self.loss_tokens[i] += float(step_losses[i][1])

    def weighted_loss(self, step_weight: float) -> float:
        """Σ_i γ^i S_i / N_0: the training loss (`DrafterLoss.normalised`) over everything accumulated, where
        S_i is step i's summed cross-entropy and N_0 the step-0 loss tokens."""
        return sum(step_weight**i * s for i, s in enumerate(self.loss_sum)) / max(self.loss_tokens[0], 1.0)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        caccs = []
        for i in range(self.steps):
            out[f"acc_{i}"] = self.correct[i] / max(self.scored[i], 1.0)
            cacc = self.cond_correct[i] / max(self.cond_scored[i], 1.0)
            out[f"cond_acc_{i}"] = cacc
            caccs.append(cacc)
            if self.loss_tokens[i]:
                out[f"loss_{i}"] = self.loss_sum[i] / self.loss_tokens[i]
        out["simulated_acceptance_length"] = simulated_acceptance_length(caccs)
        return out


def simulated_acceptance_length(conditional_accuracies: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} cacc_j: the verifier's bonus token plus the expected accepted drafts (≤ K + 1)."""
    total, running = 1.0, 1.0
    for cacc in conditional_accuracies:
        running *= cacc
        total += running
    return total


@torch.no_grad()
def drafter_step_accuracies(model: Eagle3DraftModel, dataset: SampleSource, max_seq_len: int = 2048,
                            batch_size: int = 4, ttt_steps: int | None = None) -> dict[str, float]:
    """Per-step accuracy, conditional accuracy and simulated τ of a drafter on a feature dataset (and the
    per-step loss when a teacher is attached) — the numbers the trainer logs, outside any Trainer."""
    from ..features.packing import PackedCollator, PackedDataset

    steps = int(ttt_steps or model.config.ttt_steps)
    packed = PackedDataset(dataset, max_seq_len, seed=None)
    collate = PackedCollator(max_seq_len=max_seq_len)
    device = next(model.parameters()).device
    stats = StepStats(steps)
    for start in range(0, len(packed), batch_size):
        batch = collate([packed[r] for r in range(start, min(start + batch_size, len(packed)))])
        batch = {k: v.to(device) for k, v in batch.items()}
        step = drafter_loss(model, batch, model.t2d, steps, model.config.ttt_step_weight, heads_where_read=False)
        assert step.outputs.logits is not None
        stats.update(step.outputs.logits, batch, model.d2t, model.t2d, step.step_losses)
    return stats.metrics()
