"""gpu_check's bf16 gate: bf16 training must train the drafter as fp32 training does, judged on each TTT step's
logits after a few optimizer steps, not on a loss at initialisation (which bf16 matches to 1e-6 whatever
happens after).

Two drafters from one seeded initialisation take the same optimizer steps through the real Eagle3Trainer (the
recipes' lr and clip), one in fp32 and one with `--bf16` (accelerate's autocast, fp32 master weights). Then, on a
held-out packed row, per TTT step:
- `move_rel_err`: how far the bf16 run's change of the logits (from the shared initialisation, both read in fp32)
  is from the fp32 run's change, relative to it. Broken bf16 training (updates rounded away in bf16 master
  weights, gradients cast wrongly) changes the logits otherwise;
- `forward_rel_err` and `forward_top1`: the fp32 run's weights read once under bf16 autocast against fp32 (the
  forward's own rounding).
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.train.loss import drafter_loss

from .train_step import new_drafter, packed_row, trainer_for, trainer_step

GATE_STEPS = 4
GATE_LR = 3e-5  # the Kimi-K2.5 1-GPU recipe's: the smaller the step, the more a bf16 weight would round it away
# measured with --device cpu --tiny (tests/experiments/test_gpu_check.py): move_rel_err 0.013-0.024 as built,
# 0.3-0.86 with the drafter's weights cast to bf16 before the optimizer; forward_rel_err 0.005-0.014
MOVE_RTOL = 0.1
FORWARD_RTOL = 0.05


def per_step_logits(model: Eagle3DraftModel, batch: dict, ttt_steps: int, device: str,
                    autocast: bool) -> list[torch.Tensor]:
    """Each TTT step's logits at its loss positions, [N_i, Vd] fp32, read in fp32 (or under bf16 autocast)."""
    reader = model if all(p.dtype == torch.float32 for p in model.parameters()) else _fp32_copy(model)
    was_training = reader.training
    reader.eval()
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast):
        out = drafter_loss(reader, dict(batch), reader.t2d, ttt_steps, reader.config.ttt_step_weight).outputs
    reader.train(was_training)
    assert out.logits is not None  # the TTT forward returns every step's logits
    return [logits.float() for logits in out.logits]


def _fp32_copy(model: Eagle3DraftModel) -> Eagle3DraftModel:
    import copy

    return copy.deepcopy(model).float()


def train(config: Eagle3Config, device: str, bf16: bool, ttt_steps: int, batches: list[dict], out_dir: Path,
          lr: float) -> Eagle3DraftModel:
    """The seeded drafter after len(batches) optimizer steps of the real Trainer (fp32, or --bf16)."""
    from accelerate.utils import extract_model_from_parallel

    model = new_drafter(config, device)
    trainer = trainer_for(model, device, bf16, ttt_steps, out_dir, lr=lr)
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)  # a near-constant lr over these few steps
    prepared = trainer.accelerator.prepare_model(model)  # as train() does: autocast around forward under --bf16
    for batch in batches:
        trainer_step(trainer, prepared, batch)
    drafter: Eagle3DraftModel = extract_model_from_parallel(prepared, keep_fp32_wrapper=False)  # forward unwrapped
    return drafter


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def bf16_gate(config: Eagle3Config, device: str, ttt_steps: int, row_len: int, documents: int, out_dir: Path,
              steps: int = GATE_STEPS, lr: float = GATE_LR) -> dict:
    config._attn_implementation = "sdpa"
    batches = [packed_row(config, row_len, documents, device, seed=1 + k) for k in range(steps)]
    probe = packed_row(config, row_len, documents, device, seed=1000)
    initial = per_step_logits(new_drafter(config, device), probe, ttt_steps, device, autocast=False)
    fp32_run = train(config, device, False, ttt_steps, batches, out_dir / "fp32", lr)
    fp32 = per_step_logits(fp32_run, probe, ttt_steps, device, autocast=False)
    forward = per_step_logits(fp32_run, probe, ttt_steps, device, autocast=True)
    del fp32_run
    bf16_run = train(config, device, True, ttt_steps, batches, out_dir / "bf16", lr)
    trained = per_step_logits(bf16_run, probe, ttt_steps, device, autocast=False)
    del bf16_run
    move = [rel_err(b - i, f - i) for b, f, i in zip(trained, fp32, initial)]
    forward_err = [rel_err(a, f) for a, f in zip(forward, fp32)]
    top1 = [float((a.argmax(-1) == f.argmax(-1)).float().mean()) for a, f in zip(forward, fp32)]
    changed = [rel_err(f, i) for f, i in zip(fp32, initial)]  # how far the fp32 steps moved the logits
    finite = all(bool(torch.isfinite(t).all()) for t in (*trained, *forward))
    return {"steps": steps, "lr": lr, "tokens": row_len, "move_rel_err": move, "fp32_change_rel": changed,
            "forward_rel_err": forward_err, "forward_top1": top1, "move_rtol": MOVE_RTOL, "forward_rtol": FORWARD_RTOL,
            "ok": finite and max(move) < MOVE_RTOL and max(forward_err) < FORWARD_RTOL}
