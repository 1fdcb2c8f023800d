"""One micro-step of the Trainer's own step (forward, loss, metrics, backward) makes at most 2 host
synchronisations and one attention call per TTT step, whatever the packing (DESIGN §6: on a GPU each sync
drains the launch queue). Counted on the CPU with the same counter gpu_check uses (eagle3_hf.train.host_sync)."""

from __future__ import annotations

import pytest
import torch

from eagle3_hf.train.host_sync import HostSyncCounter
from eagle3_hf.train.targets import PLAN_KEY
from eagle3_hf.train.trainer import Eagle3Trainer

from tests.train.step_helpers import tiny_trainer, trainer_batch

MAX_SYNCS_PER_MICRO_STEP = 2


def count_micro_step(trainer: Eagle3Trainer, batch: dict, plan: bool = True) -> tuple[HostSyncCounter, int]:
    """(syncs, attention calls) of one `training_step`; the loss-token count and the batch plans are the
    Trainer's, made once per optimizer step before the micro-steps (`get_batch_samples`), so outside the count
    (`plan=False`: a batch that comes without its plan, which the step then makes itself)."""
    drafter = trainer.model
    calls = 0
    attend = drafter.midlayer.self_attn.attend

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return attend(*args, **kwargs)

    drafter.midlayer.self_attn.attend = counting
    try:
        num_items = trainer._get_num_items_in_batch([batch], trainer.args.device)
        if not plan:
            del batch[PLAN_KEY]
        with HostSyncCounter() as syncs:
            trainer.training_step(drafter, batch, num_items)
    finally:
        del drafter.midlayer.self_attn.attend
    return syncs, calls


@pytest.mark.parametrize("steps,row_len,documents", [(3, 1024, 2), (7, 2048, 5)])
def test_micro_step_host_syncs_and_attention_calls(tmp_path, steps, row_len, documents):
    trainer = tiny_trainer(tmp_path, steps)
    syncs, calls = count_micro_step(trainer, trainer_batch(row_len, documents))
    print(f"\nTTT {steps}, {row_len} tokens, {documents} documents: {syncs.total} host syncs {dict(syncs.ops)}, "
          f"{calls} attention calls")
    assert syncs.total <= MAX_SYNCS_PER_MICRO_STEP, dict(syncs.ops)
    assert calls == steps


@pytest.mark.parametrize("objective", ["kl", "lk-alpha", "lk-hybrid"])
def test_each_objective_reads_the_device_once_per_optimizer_step(tmp_path, objective):
    """The acceptance losses (and their α metric) add no read: none inside gradient accumulation, the guard's one
    at the last micro-step."""
    trainer = tiny_trainer(tmp_path, 3, objective=objective)
    trainer.accelerator.gradient_state._set_sync_gradients(False)
    syncs, _ = count_micro_step(trainer, trainer_batch(512, 3))
    assert syncs.total == 0, dict(syncs.ops)
    trainer.accelerator.gradient_state._set_sync_gradients(True)
    syncs, _ = count_micro_step(trainer, trainer_batch(512, 3))
    assert syncs.total == 1 and syncs.ops["_local_scalar_dense"] == 1, dict(syncs.ops)


def test_only_the_last_micro_step_of_an_optimizer_step_reads_the_device(tmp_path):
    """The non-finite guard reads the device once per optimizer step, before the last micro-batch's backward;
    a batch without the Trainer's plan makes its own with one read: still within the bound."""
    trainer = tiny_trainer(tmp_path, 3)
    trainer.accelerator.gradient_state._set_sync_gradients(False)  # a micro-step inside gradient accumulation
    syncs, _ = count_micro_step(trainer, trainer_batch(512, 3))
    assert syncs.total == 0, dict(syncs.ops)
    trainer.accelerator.gradient_state._set_sync_gradients(True)
    syncs, _ = count_micro_step(trainer, trainer_batch(512, 3), plan=False)
    assert syncs.total <= MAX_SYNCS_PER_MICRO_STEP and syncs.ops["_local_scalar_dense"] == 1, dict(syncs.ops)


def test_the_counter_sees_what_the_old_step_did():
    """Every kind of read the step used to make is counted (a later change that brings one back fails above)."""
    x, mask = torch.randn(6), torch.tensor([True, False] * 3)
    with HostSyncCounter() as syncs:
        float(x.sum())
        x[mask]
        x.clone()[mask] = 0.0
        mask.nonzero()
        torch.unique_consecutive(mask)
        x.tolist()
        x.cpu()
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.nonzero_static(mask, size=3)  # a static size: no read
        x.index_select(0, torch.tensor([0, 2]))
    assert dict(syncs.ops) == {"_local_scalar_dense": 1, "index": 1, "index_put_": 1, "nonzero": 1,
                               "unique_consecutive": 1, "Tensor.tolist": 1, "Tensor.cpu": 1, "repeat_interleave": 1}


def test_a_non_finite_micro_batch_stops_the_optimizer_step_it_belongs_to(tmp_path):
    """Read once per optimizer step, the guard still stops at the first non-finite loss of the step, before the
    last micro-batch's backward and before any optimizer step (the weights stay as they were)."""
    from eagle3_hf.errors import NonFiniteError

    trainer = tiny_trainer(tmp_path, 3, gradient_accumulation_steps=2)
    poisoned, clean = trainer_batch(128, 2, seed=1), trainer_batch(128, 2, seed=2)
    poisoned["aux_hidden_states"][0, 5] = float("nan")
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    num_items = trainer._get_num_items_in_batch([poisoned, clean], trainer.args.device)
    trainer.accelerator.gradient_state._set_sync_gradients(False)
    trainer.training_step(trainer.model, poisoned, num_items)  # no read of the device here
    trainer.accelerator.gradient_state._set_sync_gradients(True)
    with pytest.raises(NonFiniteError, match="non-finite training loss nan at step 1"):
        trainer.training_step(trainer.model, clean, num_items)
    assert all(torch.equal(p, weights[n]) for n, p in trainer.model.named_parameters())
