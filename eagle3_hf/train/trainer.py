"""Eagle3Trainer: a transformers.Trainer that trains a drafter with training-time test on packed batches.

Everything the Trainer already does well — accelerate / DeepSpeed ZeRO, gradient accumulation, mixed
precision, checkpoints with optimizer, scheduler, RNG and data position, best-checkpoint selection — is
left to it. This file adds what it lacks: the TTT loss against the verifier's restricted distribution (or an
acceptance loss, `--objective`),
`num_items_in_batch` counted on loss tokens, per-step accuracy / conditional accuracy / simulated
acceptance length in the logs and in `evaluate()`, and saving in the standard EAGLE-3 layout.
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import Trainer

from ..constants import TRAINING_ARGS_FILE
from ..errors import NonFiniteError, describe_non_finite, non_finite_names
from .arguments import refuse_unsupported
from .dflash_loss import ANCHORS_KEY, dflash_loss, ensure_anchors, sample_anchors, step_weight
from .loss import drafter_loss
from .metrics import StepStats
from .nodes import NodeRows
from .objective import Objective
from .targets import PLAN_KEY, plan_batches

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, Dataset, Sampler
    from transformers.trainer_utils import EvalLoopOutput

    from ..model.modeling_dflash import DFlashDraftModel
    from ..model.modeling_eagle3 import Eagle3DraftModel
    from .arguments import Eagle3TrainingArguments


class Eagle3Trainer(Trainer):
    """Trainer for `Eagle3DraftModel` on batches from `PackedCollator` (or the online collator).

    The model must have its vocabulary mapping installed and its teacher attached
    (`model.attach_teacher(verifier)`) before the Trainer is built.
    """

    loss_is_scaled_for_ga = True  # the loss is divided by the global loss-token count already
    args: Eagle3TrainingArguments  # what train.arguments.parse_args builds

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # DeepSpeed may come from the accelerate config rather than --deepspeed: refuse Muon there too
        run = self.args
        refuse_unsupported(bool(run.gradient_checkpointing), run.hidden_optimizer, self.is_deepspeed_enabled)
        drafter = self.accelerator.unwrap_model(self.model)
        # a DFlash drafter (model/modeling_dflash.py) scores block positions 1 .. B - 1 where EAGLE-3 scores TTT steps;
        # its head is the verifier's own (frozen), so the lm_head options do not apply to it
        self.dflash = getattr(drafter, "drafter_kind", "eagle3") == "dflash"
        self.loss_objective: Objective = self.args.training_objective()  # what each scored row trains
        if self.dflash:
            if not drafter.verifier_weights_loaded:
                raise ValueError("load the verifier's embedding and lm_head first: model.load_verifier_weights(...)")
            self.metric_steps = drafter.config.max_drafts
            self.step_weight = step_weight(drafter.config.block_loss_decay)
        else:
            self._init_eagle3(drafter)
            self.metric_steps, self.step_weight = self.args.ttt_steps, self.args.ttt_step_weight
        steps = self.metric_steps
        self._train_stats, self._eval_stats = StepStats(steps), StepStats(steps)
        self._guard_loss: torch.Tensor | None = None  # the first non-finite loss of this optimizer step, if any

    def _init_eagle3(self, drafter: Eagle3DraftModel) -> None:
        if getattr(drafter, "verifier_lm_head", None) is None:
            raise ValueError("attach the verifier's lm_head first: model.attach_teacher(verifier)")
        # The run's TTT settings become the drafter's: its config.json records them, and what reads a drafter
        # later (drafter_step_accuracies, the speculators export) takes them from there.
        drafter.config.ttt_steps, drafter.config.ttt_step_weight = self.args.ttt_steps, self.args.ttt_step_weight
        if self.args.init_lm_head not in ("random", "verifier"):
            raise ValueError(f"init_lm_head must be 'random' or 'verifier', not {self.args.init_lm_head!r}")
        if self.args.init_lm_head == "verifier":  # before the optimizer exists; a resumed checkpoint overrides it
            drafter.init_lm_head_from_verifier()
        if self.args.freeze_lm_head:
            drafter.freeze_lm_head()
        drafter.packed_attention = self.args.packed_attention
        objective = self.args.training_objective()
        if objective.needs_in_vocab_mass and not drafter.teacher_in_vocab_mass:
            raise ValueError(f"--objective {objective.name} needs the verifier's mass outside the draft "
                             "vocabulary: attach the teacher with model.attach_teacher(verifier, in_vocab_mass=True)")

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """AdamW through the Trainer, or Muon on the hidden matrices + AdamW on the rest."""
        if self.args.hidden_optimizer != "muon" or self.optimizer is not None:
            return super().create_optimizer(model)
        from .optim import build_hybrid_optimizer

        args = self.args
        assert self.model is not None  # the Trainer was built with the drafter
        self.optimizer = build_hybrid_optimizer(self.model, args.learning_rate, args.weight_decay,
                                                (args.adam_beta1, args.adam_beta2), args.adam_epsilon)
        return self.optimizer

    # ------------------------------------------------------------------ each node's own rows

    def _get_train_sampler(self, train_dataset: Dataset[Any] | None = None) -> Sampler[int] | None:
        """`--per-node-features`: each node reads its own part (train/nodes.py); else the Trainer's sampler."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if isinstance(dataset, NodeRows):
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return node_sampler(dataset, self._train_batch_size, True, seed)
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset: Dataset[Any]) -> Sampler[int] | None:
        if isinstance(eval_dataset, NodeRows):
            return node_sampler(eval_dataset, self.args.eval_batch_size, False, 0)
        return super()._get_eval_sampler(eval_dataset)

    # ------------------------------------------------------------------ loss

    def _drafter(self) -> Eagle3DraftModel:
        drafter: Eagle3DraftModel = self.accelerator.unwrap_model(self.model)
        return drafter

    def _dflash_drafter(self) -> DFlashDraftModel:
        drafter: DFlashDraftModel = self.accelerator.unwrap_model(self.model)
        return drafter

    def _get_num_items_in_batch(self, batch_samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        """The optimizer step's loss tokens; on the way, each micro-batch's plan (`targets.BatchPlan`: where the
        heads and the loss read, as indices), all made with one read of the device, so that the micro-steps
        make none. DFlash: each micro-batch's anchors, drawn here, and their number."""
        if self.dflash:
            per_row = self._dflash_drafter().anchors_per_row
            count = torch.tensor(sum(int((ensure_anchors(b, per_row) >= 0).sum()) for b in batch_samples),
                                 device=device)
        else:
            plans = plan_batches(batch_samples, self.args.ttt_steps, self._drafter().t2d)
            for batch, plan in zip(batch_samples, plans):
                batch[PLAN_KEY] = plan
            count = torch.tensor(sum(plan.loss_counts[0] for plan in plans), device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Σ_i γ^i Σ_t loss(teacher_{t+1+i}, draft_i(t)) over loss positions / loss tokens in the global batch (a
        DFlash drafter: Σ_k w_k Σ_anchors loss at block position k, over the step's anchors), the loss being the
        run's objective (the soft cross-entropy by default)."""
        noise = self.args.feature_noise_std if model.training else 0.0
        stats = self._train_stats if model.training else self._eval_stats
        if self.dflash:
            per_row = self._dflash_drafter().anchors_per_row
            if not model.training and ANCHORS_KEY not in inputs:  # the same blocks at every evaluation
                inputs[ANCHORS_KEY] = sample_anchors(inputs, per_row, torch.Generator().manual_seed(0))
            step = dflash_loss(model, inputs, per_row, noise, self.loss_objective)
            assert step.counts is not None
            stats.add(step.counts)
        else:
            drafter = self._drafter()
            step = drafter_loss(model, inputs, drafter.t2d, self.args.ttt_steps, self.args.ttt_step_weight, noise,
                                objective=self.loss_objective)
            assert isinstance(step.outputs.logits, tuple)  # the TTT forward returns every step's logits
            stats.update(step.outputs.logits, inputs, drafter.d2t, drafter.t2d, step.step_losses,
                         logits_mask=step.logits_mask, head_rows=step.head_rows, step_alphas=step.step_alphas)
        outputs = step.outputs
        loss = step.normalised(num_items_in_batch)
        if model.training:
            self._guard_non_finite(loss)
        if model.training and self.args.average_tokens_across_devices and self.args.world_size > 1:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients; we want the global sum
        return (loss, outputs) if return_outputs else loss

    def _guard_non_finite(self, loss: torch.Tensor) -> None:
        """Stop at a non-finite loss before the optimizer step it would reach (it would make every weight NaN).

        The check reads the device once per optimizer step, at its last micro-batch and before that batch's
        backward (DeepSpeed steps its optimizer inside the backward): earlier micro-batches only keep the first
        non-finite loss on the device."""
        loss = loss.detach().float()
        kept = self._guard_loss
        self._guard_loss = loss if kept is None else torch.where(torch.isfinite(kept), loss, kept)
        if not self.accelerator.sync_gradients:
            return
        value, self._guard_loss = self._guard_loss.item(), None
        if not math.isfinite(value):
            raise NonFiniteError(
                f"non-finite training loss {value} at step {self.state.global_step + 1} "
                f"(learning rate {self._get_learning_rate() if self.lr_scheduler else self.args.learning_rate}); "
                "stopping before it reaches the weights or a checkpoint")

    # ------------------------------------------------------------------ metrics

    def _reduced(self, stats: StepStats) -> dict[str, float]:
        return self._reduced_stats(stats).metrics()

    def _reduced_stats(self, stats: StepStats) -> StepStats:
        tensor = stats.as_tensor(self.args.device)
        if self.args.world_size > 1:
            tensor = self.accelerator.reduce(tensor, reduction="sum")
        return StepStats.from_tensor(tensor)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            logs.update({k: round(v, 4) for k, v in self._reduced(self._train_stats).items()})
            self._train_stats = StepStats(self.metric_steps)
        super().log(logs, start_time)

    def prediction_step(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        assert isinstance(loss, torch.Tensor)  # return_outputs=False: the loss alone
        return loss.detach(), None, None

    def evaluation_loop(self, dataloader: DataLoader[dict[str, Any]], description: str,
                        prediction_loss_only: bool | None = None, ignore_keys: list[str] | None = None,
                        metric_key_prefix: str = "eval") -> EvalLoopOutput:
        self._eval_stats = StepStats(self.metric_steps)
        output = super().evaluation_loop(dataloader, description, True, ignore_keys, metric_key_prefix)
        reduced = self._reduced_stats(self._eval_stats)
        metrics = reduced.metrics()
        # the training loss's quantity over the whole evaluation set: Σ_i γ^i S_i / N_0, per step-0 loss token
        metrics["loss"] = reduced.weighted_loss(self.step_weight)
        assert output.metrics is not None  # the Trainer's loop always returns its metrics
        output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in metrics.items()})
        return output

    # ------------------------------------------------------------------ saving

    def _save(self, output_dir: str | None = None, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """The standard EAGLE-3 layout (what SGLang/vLLM load) and the arguments as JSON, no pickles."""
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        assert output_dir is not None  # TrainingArguments.__post_init__ sets a default output_dir
        tensors = state_dict if state_dict is not None else self._drafter().state_dict()
        bad = non_finite_names(tensors)
        if bad:
            raise NonFiniteError(f"refusing to save {output_dir}: {describe_non_finite(bad)}")
        os.makedirs(output_dir, exist_ok=True)
        self._drafter().save_pretrained(output_dir, state_dict=state_dict, is_main_process=True)  # should_save
        with open(os.path.join(output_dir, TRAINING_ARGS_FILE), "w", encoding="utf-8") as f:
            f.write(self.args.to_json_string())  # type: ignore[no-untyped-call]  # unannotated in transformers


def node_sampler(rows: NodeRows, batch_size: int, shuffle: bool, seed: int) -> Sampler[int]:
    """NodeRows' order is made for the batch size its blocks were sized for."""
    if batch_size != rows.batch:
        raise ValueError(f"--per-node-features: the rows were spread for batches of {rows.batch}, the loader makes "
                         f"batches of {batch_size}")
    return rows.sampler(shuffle, seed)


def training_summary(trainer: Eagle3Trainer, eval_metrics: dict[str, float], **extra: Any) -> dict[str, Any]:
    """`eagle3_training.json`: what the model card reports (recipe + measured per-step metrics)."""
    steps = trainer.metric_steps  # TTT steps, or a DFlash drafter's block positions 1 .. B - 1
    metrics: dict[str, Any] = {
        "step_accuracy": [eval_metrics.get(f"eval_acc_{i}") for i in range(steps)],
        "step_conditional_accuracy": [eval_metrics.get(f"eval_cond_acc_{i}") for i in range(steps)],
        "simulated_acceptance_length": eval_metrics.get("eval_simulated_acceptance_length"),
    }
    if "eval_simulated_acceptance_length_t1" in eval_metrics:  # measured with the teacher's mass
        metrics["step_alpha"] = [eval_metrics.get(f"eval_alpha_{i}") for i in range(steps)]
        metrics["simulated_acceptance_length_t1"] = eval_metrics["eval_simulated_acceptance_length_t1"]
    return {
        **extra,
        "recipe": {**extra.get("recipe", {}), "epochs": trainer.args.num_train_epochs,
                   "learning_rate": trainer.args.learning_rate, "ttt_steps": steps,
                   "step_weight": trainer.step_weight, "init_lm_head": trainer.args.init_lm_head,
                   "freeze_lm_head": trainer.args.freeze_lm_head, "objective": trainer.args.objective,
                   **({"lk_eta": trainer.args.lk_eta} if trainer.args.objective == "lk-hybrid" else {})},
        "metrics": metrics,
    }


def write_json(path: str, payload: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
