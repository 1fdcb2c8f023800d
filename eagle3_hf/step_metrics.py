"""TTT targets, the loss and per-step metrics — one definition shared by the trainer, evaluation and diff.

For step i the drafter's output at position t predicts token t + 2 + i (docs/contracts.md, TTT). Its teacher is the
verifier's distribution at position t + 1 + i (restricted to the draft vocabulary, renormalised), its
greedy reference is `verifier_greedy[t + 1 + i]`, and it counts only where token t + 2 + i is an
assistant token of the same document. Positions whose greedy token lies outside the draft vocabulary
carry no loss but count as misses in accuracy (such a token can never be accepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .checkpoint import draft_to_target
from .ttt_attention import shift_within_documents


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


LOSS_CHUNK_ELEMENTS = 1 << 23  # rows x draft vocab per block of the soft cross-entropy (32 MiB in fp32)


class _SoftCrossEntropy(torch.autograd.Function):
    """Σ_k CE(probs[teacher_rows[k]], student[student_rows[k]]) over student [N, Vd] and probs [M, Vd].

    Loss and gradient (softmax(student) Σp - p, the log-softmax backward) are computed a block of rows at a
    time, so no gathered, shifted or log-softmaxed copy of the logits ever exists: beyond the inputs, which
    the caller keeps anyway, the only full-size tensor is the gradient of the logits themselves."""

    @staticmethod
    def forward(ctx, student, probs, student_rows, teacher_rows):
        ctx.save_for_backward(student, probs, student_rows, teacher_rows)
        total = student.new_zeros((), dtype=torch.float32)
        for s, t in _row_blocks(student_rows, teacher_rows, student.shape[-1]):
            total -= (probs[t] * F.log_softmax(student[s].float(), dim=-1)).sum()
        return total

    @staticmethod
    def backward(ctx, grad_output):
        student, probs, student_rows, teacher_rows = ctx.saved_tensors
        grad = torch.zeros_like(student)
        for s, t in _row_blocks(student_rows, teacher_rows, student.shape[-1]):
            p = probs[t]
            q = F.softmax(student[s].float(), dim=-1)
            grad[s] = ((q * p.sum(-1, keepdim=True) - p) * grad_output).to(grad.dtype)
        return grad, None, None, None


def _row_blocks(student_rows: torch.Tensor, teacher_rows: torch.Tensor, vocab: int):
    size = max(1, LOSS_CHUNK_ELEMENTS // vocab)
    for start in range(0, student_rows.numel(), size):
        yield student_rows[start : start + size], teacher_rows[start : start + size]


def _rows_of(positions: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """Flat [B * L] positions -> row numbers in a tensor that holds only the `kept` [B, L] positions."""
    if kept is None:
        return positions
    return (kept.flatten().cumsum(0) - 1)[positions]


def soft_cross_entropy_at(student_logits: torch.Tensor, teacher_probs: torch.Tensor, mask: torch.Tensor,
                          shift: int, logits_mask: torch.Tensor | None = None,
                          teacher_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over masked positions t of CE(teacher_probs[t + shift], student[t]).

    student [B, L, Vd] (or its rows [N, Vd] at `logits_mask`), teacher_probs [B, L, Vd] (or its rows at
    `teacher_mask`; fp32, the teacher distribution shared by every TTT step), mask [B, L] (already guarantees
    t + shift is in t's document; inside both masks)."""
    flat = mask.flatten().nonzero().squeeze(1)  # b * L + t
    if flat.numel() == 0:
        return student_logits.sum() * 0.0
    vocab = student_logits.shape[-1]
    student_rows = _rows_of(flat, logits_mask)
    teacher_rows = _rows_of(flat + shift, teacher_mask)
    return _SoftCrossEntropy.apply(student_logits.reshape(-1, vocab), teacher_probs.reshape(-1, vocab),
                                   student_rows, teacher_rows)


def head_positions(batch: dict[str, torch.Tensor], steps: int, t2d: torch.Tensor):
    """(per step, where its logits are read: scored positions; where the teacher is read: t + 1 + i for the
    loss positions t of step i). Passed to the forward as `logits_mask` / `teacher_mask`, they keep both
    heads off prompt tokens and document tails."""
    logits_mask, teacher_mask = [], torch.zeros_like(batch["document_ids"], dtype=torch.bool)
    for i in range(steps):
        targets = step_targets(batch, i, t2d)
        logits_mask.append(targets.teacher_position_valid)
        teacher_mask[:, i + 1 :] |= targets.loss_mask[:, : -(i + 1)]
    return tuple(logits_mask), teacher_mask


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

    def __post_init__(self):
        for name in ("scored", "correct", "cond_scored", "cond_correct", "loss_sum", "loss_tokens"):
            setattr(self, name, [0.0] * self.steps)

    def as_tensor(self, device=None) -> torch.Tensor:
        return torch.tensor([self.scored, self.correct, self.cond_scored, self.cond_correct, self.loss_sum,
                             self.loss_tokens], dtype=torch.float64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepStats":
        stats = cls(t.shape[1])
        rows = t.double().cpu().tolist()
        stats.scored, stats.correct, stats.cond_scored, stats.cond_correct, stats.loss_sum, stats.loss_tokens = rows
        return stats

    @torch.no_grad()
    def update(self, logits: tuple, batch: dict, d2t: torch.Tensor, t2d: torch.Tensor, step_losses=None,
               logits_mask: tuple | None = None) -> None:
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


def ttt_loss(outputs, batch: dict[str, torch.Tensor], t2d: torch.Tensor, step_weight: float):
    """(Σ_i γ^i Σ_t CE_i(t) summed, not yet normalised; per-step (loss sum, loss tokens)) for one batch."""
    total = outputs.logits[0].new_zeros(())
    step_losses = []
    for i, logits in enumerate(outputs.logits):
        mask = step_targets(batch, i, t2d).loss_mask
        step_loss = soft_cross_entropy_at(logits, outputs.teacher_probs, mask, i + 1,
                                          None if outputs.logits_mask is None else outputs.logits_mask[i],
                                          outputs.teacher_mask)
        total = total + (step_weight**i) * step_loss
        step_losses.append((step_loss.detach(), mask.sum()))
    return total, step_losses


@dataclass
class DrafterLoss:
    """One batch through the drafter: the unnormalised loss, what normalises it, and what the metrics read."""

    total: torch.Tensor | None  # Σ_i γ^i Σ_t CE_i(t) over the batch's loss positions (None without a teacher)
    loss_tokens: torch.Tensor  # step-0 loss positions of this batch (the Trainer's num_items_in_batch share)
    step_losses: list | None  # per step (loss sum, loss tokens)
    outputs: object  # the model's Eagle3DraftOutput
    logits_mask: tuple | None  # where each step's logits were computed (None: every position)


def drafter_loss(model, batch: dict[str, torch.Tensor], t2d: torch.Tensor, ttt_steps: int, step_weight: float,
                 feature_noise_std: float = 0.0, heads_where_read: bool = True) -> DrafterLoss:
    """The training step's loss, defined once: the Trainer, the metrics and every bench call this, so a change
    to the loss is made here and a bench measures exactly the Trainer's step.

    `model` may be wrapped (DDP, DeepSpeed); `t2d` is the drafter's mask. `heads_where_read` computes the
    draft and teacher heads only at the positions the loss and the metrics read (`head_positions`).
    Divide `total` by the global loss-token count (`loss_tokens` summed over the batches of an optimizer step).
    """
    features = batch["aux_hidden_states"]
    if feature_noise_std > 0:
        features = features + torch.randn_like(features) * feature_noise_std
    logits_mask, teacher_mask = head_positions(batch, ttt_steps, t2d) if heads_where_read else (None, None)
    outputs = model(
        input_ids=batch["input_ids"],
        aux_hidden_states=features,
        position_ids=batch["position_ids"],
        document_ids=batch["document_ids"],
        last_hidden_state=batch["last_hidden_state"],
        ttt_steps=ttt_steps,
        logits_mask=logits_mask,
        teacher_mask=teacher_mask,
    )
    total = step_losses = None
    if outputs.teacher_probs is not None:
        total, step_losses = ttt_loss(outputs, batch, t2d, step_weight)
    return DrafterLoss(total, count_loss_tokens(batch, t2d), step_losses, outputs, logits_mask)


@torch.no_grad()
def drafter_step_accuracies(model, dataset, max_seq_len: int = 2048, batch_size: int = 4,
                            ttt_steps: int | None = None) -> dict[str, float]:
    """Per-step accuracy, conditional accuracy and simulated τ of a drafter on a feature dataset (and the
    per-step loss when a teacher is attached) — the numbers the trainer logs, outside any Trainer."""
    from .data.dataset import PackedCollator, PackedDataset

    steps = int(ttt_steps or model.config.ttt_steps)
    packed = PackedDataset(dataset, max_seq_len, seed=None)
    collate = PackedCollator(max_seq_len=max_seq_len)
    device = next(model.parameters()).device
    stats = StepStats(steps)
    for start in range(0, len(packed), batch_size):
        batch = collate([packed[r] for r in range(start, min(start + batch_size, len(packed)))])
        batch = {k: v.to(device) for k, v in batch.items()}
        step = drafter_loss(model, batch, model.t2d, steps, model.config.ttt_step_weight, heads_where_read=False)
        stats.update(step.outputs.logits, batch, model.d2t, model.t2d, step.step_losses)
    return stats.metrics()
