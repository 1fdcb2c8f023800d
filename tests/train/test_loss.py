"""The loss is one quantity: the optimizer's loss (`DrafterLoss.normalised`), the evaluation loss
(`StepStats.weighted_loss`) and every bench read Σ_i γ^i S_i / N_0."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.model.checkpoint import vocab_from_target_ids
from eagle3_hf.train.loss import drafter_loss
from eagle3_hf.train.metrics import StepStats

VOCAB, HIDDEN, DRAFT_VOCAB, STEPS, GAMMA = 300, 32, 64, 3, 0.8


def _drafter() -> Eagle3DraftModel:
    torch.manual_seed(0)
    verifier = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2)
    config = Eagle3Config.from_verifier(verifier, draft_vocab_size=DRAFT_VOCAB)
    config._attn_implementation = "sdpa"
    model = Eagle3DraftModel(config)
    model.set_vocab_mapping(*vocab_from_target_ids(torch.arange(0, 2 * DRAFT_VOCAB, 2), VOCAB))
    model.attach_teacher(torch.randn(VOCAB, HIDDEN))
    return model


def _batch(seed: int, docs: list[int]) -> dict[str, torch.Tensor]:
    """One packed row of documents of the given lengths, the first third of each a prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    length = sum(docs)
    document_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(docs)])[None]
    position_ids = torch.cat([torch.arange(n) for n in docs])[None]
    loss_mask = torch.cat([torch.arange(n) >= n // 3 for n in docs])[None].long()
    # greedy tokens mostly inside the draft vocabulary (even ids), some outside
    return {"input_ids": torch.randint(0, VOCAB, (1, length), generator=g),
            "aux_hidden_states": torch.randn(1, length, 3 * HIDDEN, generator=g),
            "last_hidden_state": torch.randn(1, length, HIDDEN, generator=g),
            "verifier_greedy": torch.randint(0, 2 * DRAFT_VOCAB + 20, (1, length), generator=g),
            "document_ids": document_ids, "position_ids": position_ids, "loss_mask": loss_mask}


def test_evaluation_loss_is_the_training_loss_of_the_same_batches():
    model = _drafter()
    batches = [_batch(0, [20, 12]), _batch(1, [9, 25, 6])]
    steps = [drafter_loss(model, b, model.t2d, STEPS, GAMMA) for b in batches]
    # the optimizer's loss when both batches make one optimizer step: Σ totals / Σ step-0 loss tokens
    items = sum(s.loss_tokens for s in steps)
    training = float(sum(s.normalised(items) for s in steps).detach())
    stats = StepStats(STEPS)
    for step, batch in zip(steps, batches):
        stats.update(step.outputs.logits, batch, model.d2t, model.t2d, step.step_losses, logits_mask=step.logits_mask)
    assert stats.weighted_loss(GAMMA) == pytest.approx(training, rel=1e-5)
    # the formula the evaluation used before, Σ γ^i S_i / N_i, is another number: later steps score fewer tokens
    per_step = sum(GAMMA**i * stats.loss_sum[i] / stats.loss_tokens[i] for i in range(STEPS))
    assert stats.loss_tokens[STEPS - 1] < stats.loss_tokens[0]
    assert per_step != pytest.approx(training, rel=1e-3)


def test_one_batch_normalises_by_its_own_step0_tokens():
    model = _drafter()
    step = drafter_loss(model, _batch(2, [30]), model.t2d, STEPS, GAMMA)
    assert float(step.normalised()) == pytest.approx(float(step.total / step.loss_tokens), rel=1e-6)
    assert float(step.normalised(2 * step.loss_tokens)) == pytest.approx(float(step.normalised()) / 2, rel=1e-6)


def test_without_a_teacher_the_loss_is_refused_in_one_line():
    model = _drafter()
    model.verifier_lm_head = None
    step = drafter_loss(model, _batch(3, [16]), model.t2d, STEPS, GAMMA)
    with pytest.raises(ValueError, match="attach_teacher"):
        step.normalised()
