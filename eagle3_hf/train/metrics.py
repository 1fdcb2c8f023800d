"""Per-step metrics of a drafter — accuracy, conditional accuracy, simulated τ — shared by the trainer,
evaluation and diff. They score against the loss's targets (`loss.step_targets`, whose module docstring states
the alignment); a position whose greedy token lies outside the draft vocabulary counts as a miss, since such a
token can never be accepted.

Where the teacher gives its in-vocabulary mass (the acceptance losses, train/objective.py), also per step the mean
acceptance rate α = Σ_v min(p_v, q_v) over the loss positions, and the simulated acceptance length at temperature 1,
1 + Σ_k Π_{j≤k} mean α_j: the expected accepted length under speculative sampling at T = 1 were each step accepted
independently with its mean α (an approximation: the unroll feeds the data's tokens, not sampled drafts, and the
mean of a product is not the product of means). Its positions are the loss's, so those whose greedy token lies
outside the draft vocabulary are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..model.checkpoint import draft_to_target
from ..publish.served_acceptance import implied_tau  # 1 + Σ_k Π_{j≤k} c_j, one formula for training and serving
from .loss import drafter_loss, step_targets

if TYPE_CHECKING:
    from ..features.packing import SampleSource
    from ..model.head_rows import HeadRows
    from ..model.modeling_eagle3 import Eagle3DraftModel


_FIELDS = ("scored", "correct", "cond_scored", "cond_correct", "loss_sum", "loss_tokens", "alpha_sum", "alpha_rows")


@dataclass
class StepStats:
    """Counts accumulated over batches (and reduced over processes) -> accuracy, conditional accuracy, τ.

    The counts stay on the batches' device as one float64 tensor [8, steps] (`_FIELDS` x TTT steps): `update`
    adds to it without reading anything back, and the host reads it when the metrics are asked for (logging),
    not at every micro-step."""

    steps: int
    totals: torch.Tensor | None = None  # [8, steps] float64, or None before the first batch
    _host: list[list[float]] | None = field(default=None, repr=False)

    def as_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        if self.totals is None:
            return torch.zeros(len(_FIELDS), self.steps, dtype=torch.float64, device=device)
        return self.totals.to(device) if device is not None else self.totals

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StepStats:
        return cls(t.shape[1], t.double())

    def _rows(self) -> list[list[float]]:
        if self._host is None:  # the one read of the device, cached until the next update
            self._host = self.as_tensor().cpu().tolist()
        return self._host

    @property
    def scored(self) -> list[float]:
        return self._rows()[0]

    @property
    def correct(self) -> list[float]:
        return self._rows()[1]

    @property
    def cond_scored(self) -> list[float]:
        return self._rows()[2]

    @property
    def cond_correct(self) -> list[float]:
        return self._rows()[3]

    @property
    def loss_sum(self) -> list[float]:
        return self._rows()[4]

    @property
    def loss_tokens(self) -> list[float]:
        return self._rows()[5]

    @property
    def alpha_sum(self) -> list[float]:
        return self._rows()[6]

    @property
    def alpha_rows(self) -> list[float]:
        return self._rows()[7]

    @torch.no_grad()
    def update(self, logits: tuple[torch.Tensor, ...], batch: dict[str, Any], d2t: torch.Tensor, t2d: torch.Tensor,
               step_losses: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               logits_mask: tuple[torch.Tensor, ...] | None = None, head_rows: HeadRows | None = None,
               step_alphas: list[torch.Tensor] | None = None) -> None:
        """Add one batch. A position is 'right' at step i when the draft argmax, mapped to a verifier id,
        equals the verifier's greedy token; the conditional count needs steps 0..i-1 right at that anchor.
        `step_alphas[i]`: Σ α over step i's loss positions (`DrafterLoss.step_alphas`), counted over its loss tokens.

        `logits[i]` holds every position [B, L, Vd], or the rows at `head_rows.logits[i]` / `logits_mask[i]`
        (which hold every scored position); with `head_rows` no host synchronisation."""
        all_right = None
        per_step = []
        for i in range(self.steps):
            targets = step_targets(batch, i, t2d)
            if head_rows is not None:
                draft = torch.zeros_like(targets.greedy).view(-1).index_copy_(
                    0, head_rows.logits[i], logits[i].argmax(dim=-1)).view_as(targets.greedy)
            elif logits_mask is not None:  # a bool mask: the host reads how many rows it selects
                draft = torch.zeros_like(targets.greedy)
                draft[logits_mask[i]] = logits[i].argmax(dim=-1)
            else:
                draft = logits[i].argmax(dim=-1)
            right = (draft_to_target(d2t, draft) == targets.greedy) & targets.teacher_position_valid
            scored = targets.teacher_position_valid
            cond = scored if all_right is None else scored & all_right
            all_right = right if all_right is None else all_right & right
            zero = scored.new_zeros((), dtype=torch.float64)
            loss_sum, loss_tokens = (zero, zero) if step_losses is None else step_losses[i]
            alpha_sum, alpha_rows = (zero, zero) if step_alphas is None or step_losses is None else (
                step_alphas[i], step_losses[i][1])
            per_step.append(torch.stack([scored.sum().double(), right.sum().double(), cond.sum().double(),
                                         (right & cond).sum().double(), loss_sum.double(), loss_tokens.double(),
                                         alpha_sum.double(), alpha_rows.double()]))
        self.add(torch.stack(per_step, dim=1))  # [8, steps]

    def add(self, added: torch.Tensor) -> None:
        """Add one batch's counts [8, steps] (`_FIELDS` x steps), made by `update` or by the DFlash loss."""
        self.totals = added if self.totals is None else self.totals + added.to(self.totals.device)
        self._host = None

    def weighted_loss(self, step_weight: float) -> float:
        """Σ_i γ^i S_i / N_0: the training loss (`DrafterLoss.normalised`) over everything accumulated, where
        S_i is step i's summed cross-entropy and N_0 the step-0 loss tokens."""
        return sum(step_weight**i * s for i, s in enumerate(self.loss_sum)) / max(self.loss_tokens[0], 1.0)

    def metrics(self) -> dict[str, float]:
        rows = dict(zip(_FIELDS, self._rows()))
        out: dict[str, float] = {}
        caccs = []
        for i in range(self.steps):
            out[f"acc_{i}"] = rows["correct"][i] / max(rows["scored"][i], 1.0)
            cacc = rows["cond_correct"][i] / max(rows["cond_scored"][i], 1.0)
            out[f"cond_acc_{i}"] = cacc
            caccs.append(cacc)
            if rows["loss_tokens"][i]:
                out[f"loss_{i}"] = rows["loss_sum"][i] / rows["loss_tokens"][i]
        out["simulated_acceptance_length"] = implied_tau(caccs)
        if any(rows["alpha_rows"]):  # the teacher gave its mass: α measured
            alphas = [a / max(n, 1.0) for a, n in zip(rows["alpha_sum"], rows["alpha_rows"])]
            out.update({f"alpha_{i}": a for i, a in enumerate(alphas)})
            out["simulated_acceptance_length_t1"] = implied_tau(alphas)
        return out


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
        assert isinstance(step.outputs.logits, tuple)  # an EAGLE-3 drafter: one logits tensor per TTT step
        stats.update(step.outputs.logits, batch, model.d2t, model.t2d, step.step_losses,  # every position's logits
                     step_alphas=step.step_alphas)
    return stats.metrics()
