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
from .kind_training import KindTraining, kind_training
from .metrics import StepStats
from .nodes import NodeRows
from .objective import Objective

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, Dataset, Sampler
    from transformers import PreTrainedModel
    from transformers.trainer_utils import EvalLoopOutput

    from .arguments import Eagle3TrainingArguments


class Eagle3Trainer(Trainer):
    """Trainer for a drafter of any kind in engines/table.py on batches from `PackedCollator` (or the online
    collator); what differs by kind is the kind's own step (kind_training.KindTraining).

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
        self.loss_objective: Objective = self.args.training_objective()  # what each scored row trains
        # the kind's own step (engines/table.py names it): EAGLE-3 scores TTT steps, DFlash block positions
        self.kind: KindTraining = kind_training(self._drafter(), self.args, self._drafter)
        self.metric_steps, self.step_weight = self.kind.metric_steps, self.kind.step_weight
        steps = self.metric_steps
        self._train_stats, self._eval_stats = StepStats(steps), StepStats(steps)
        self._guard_loss: torch.Tensor | None = None  # the first non-finite loss of this optimizer step, if any

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

    def _drafter(self) -> PreTrainedModel:
        drafter: PreTrainedModel = self.accelerator.unwrap_model(self.model)
        return drafter

    def _get_num_items_in_batch(self, batch_samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        """The optimizer step's loss items, counted by the drafter's kind, which prepares each micro-batch on the way
        (EAGLE-3's plan of where the heads and the loss read, DFlash's anchors) with one read of the device, so
        that the micro-steps make none."""
        count = self.kind.loss_items(batch_samples, device)
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
        step = self.kind.loss(model, inputs, noise, self.loss_objective, stats)
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
