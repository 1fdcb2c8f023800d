"""The Trainer's step computes the same thing however it is run: bf16 autocast (as `--bf16` runs it) against fp32
within bf16 tolerance, gradient accumulation 2 x 1 row against 1 x 2 rows, the row attention path against the
per-document one; and the distributed defaults hold (every trained parameter gets a gradient, so DDP runs without
find_unused_parameters; gradient checkpointing and Muon under DeepSpeed are refused in one line)."""

from __future__ import annotations

import pytest
import torch

from eagle3_hf.train.arguments import Eagle3TrainingArguments

from tests.train.step_helpers import tiny_trainer, trainer_batch

# bf16 keeps 8 significant bits: per-element errors of ~0.4 % compound through the layer, the heads and the loss
BF16_LOSS_RTOL = 2e-2
BF16_GRAD_RTOL = 5e-2  # |g_bf16 - g_fp32| / |g_fp32| per parameter tensor (norms)


def step_grads(trainer, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss summed over the micro-batches of one optimizer step and the accumulated gradients, through
    `Eagle3Trainer._get_num_items_in_batch` and `training_step` with the Trainer's sync flag per micro-batch."""
    model = trainer.accelerator.prepare_model(trainer.model)  # as train() does: under --bf16, autocast on forward
    model.zero_grad(set_to_none=True)
    num_items = trainer._get_num_items_in_batch(batches, trainer.args.device)
    total = 0.0
    for k, batch in enumerate(batches):
        trainer.accelerator.gradient_state._set_sync_gradients(k == len(batches) - 1)
        total += float(trainer.training_step(model, batch, num_items))
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


def test_bf16_autocast_step_matches_fp32(tmp_path):
    batch = trainer_batch(512, 4, rows=2)
    loss32, grads32 = step_grads(tiny_trainer(tmp_path / "fp32", 7), [dict(batch)])
    trainer = tiny_trainer(tmp_path / "bf16", 7, bf16=True)
    assert trainer.accelerator.mixed_precision == "bf16"
    loss16, grads16 = step_grads(trainer, [dict(batch)])
    assert loss16 == pytest.approx(loss32, rel=BF16_LOSS_RTOL)
    errors = {n: relative(grads16[n], g) for n, g in grads32.items()}
    assert max(errors.values()) < BF16_GRAD_RTOL, errors


def test_gradient_accumulation_of_two_rows_equals_one_batch_of_two(tmp_path):
    batch = trainer_batch(256, 3, rows=2, seed=3)
    rows = [{k: v[r : r + 1] for k, v in batch.items()} for r in range(2)]
    loss_one, grads_one = step_grads(tiny_trainer(tmp_path / "one", 3), [batch])
    loss_two, grads_two = step_grads(tiny_trainer(tmp_path / "two", 3, gradient_accumulation_steps=2), rows)
    assert loss_two == pytest.approx(loss_one, rel=1e-5)
    for name, g in grads_one.items():
        torch.testing.assert_close(grads_two[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_row_and_document_attention_give_the_same_step(tmp_path):
    batch = trainer_batch(256, 4, rows=2, seed=5)
    loss_row, grads_row = step_grads(tiny_trainer(tmp_path / "row", 4, packed_attention="row"), [dict(batch)])
    loss_doc, grads_doc = step_grads(tiny_trainer(tmp_path / "doc", 4, packed_attention="document"), [dict(batch)])
    assert loss_row == pytest.approx(loss_doc, rel=1e-5)
    for name, g in grads_doc.items():
        torch.testing.assert_close(grads_row[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("freeze_lm_head", [False, True])
def test_every_trained_parameter_gets_a_gradient_so_ddp_needs_no_unused_search(tmp_path, freeze_lm_head):
    trainer = tiny_trainer(tmp_path, 3, freeze_lm_head=freeze_lm_head)
    assert trainer.args.ddp_find_unused_parameters is False
    no_loss = trainer_batch(128, 2)
    no_loss["loss_mask"][:] = False  # a micro-batch without a single loss position still touches every weight
    for batch in (trainer_batch(128, 2), no_loss):
        _, grads = step_grads(trainer, [batch])
        trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
        assert set(grads) == trained and all(g is not None for g in grads.values())
        assert ("lm_head.weight" in trained) is not freeze_lm_head and "embed_tokens.weight" not in trained


def test_gradient_checkpointing_and_muon_under_deepspeed_are_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="^--gradient_checkpointing is not supported[^\n]*$"):
        Eagle3TrainingArguments(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=True)
    with pytest.raises(ValueError, match="^--hidden-optimizer muon cannot run under DeepSpeed[^\n]*$"):
        Eagle3TrainingArguments(output_dir=str(tmp_path), use_cpu=True, hidden_optimizer="muon",
                                deepspeed="ds_configs/zero2.json")
