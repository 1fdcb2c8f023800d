"""EAGLE-3's training step for the Trainer (kind_training.KindTraining): the TTT loss over the chain's steps on
the draft vocabulary, each micro-batch's plan (targets.BatchPlan) made when the step's items are counted."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .loss import DrafterLoss, drafter_loss
from .targets import PLAN_KEY, plan_batches

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from ..model.modeling_eagle3 import Eagle3DraftModel
    from .arguments import DataArguments, Eagle3TrainingArguments, ModelArguments
    from .metrics import StepStats
    from .nodes import TrainingNodes
    from .objective import Objective
    from .training_data import TrainingFeatures


class ChainTraining:
    @staticmethod
    def build(model_args: ModelArguments, data_args: DataArguments, verifier_config: PreTrainedConfig,
              features: TrainingFeatures, nodes: TrainingNodes | None,
              ) -> tuple[Eagle3DraftModel, dict[str, Any], dict[str, Any]]:
        """One Llama layer sized from the verifier over the draft vocabulary (the same on every node), from
        scratch or --finetune-from an existing drafter (mismatches are logged loudly)."""
        from .nodes import check_same_vocabulary
        from .setup import build_drafter
        from .training_data import load_vocabulary

        d2t, t2d = load_vocabulary(data_args, features, verifier_config)
        if nodes:
            check_same_vocabulary(d2t, nodes.layout)
        model, init = build_drafter(model_args, verifier_config, d2t, t2d, list(features.identity.aux_layer_indices),
                                    features.identity.tokenizer_fingerprint, features.tokenizer.get("tokenizer_class"),
                                    features.tokenizer.get("chat_template_kwargs"))
        return model, init, {}

    def __init__(self, drafter: Eagle3DraftModel, args: Eagle3TrainingArguments,
                 unwrapped: Callable[[], nn.Module]):
        if getattr(drafter, "verifier_lm_head", None) is None:
            raise ValueError("attach the verifier's lm_head first: model.attach_teacher(verifier)")
        # The run's TTT settings become the drafter's: its config.json records them, and what reads a drafter
        # later (drafter_step_accuracies, the speculators export) takes them from there.
        drafter.config.ttt_steps, drafter.config.ttt_step_weight = args.ttt_steps, args.ttt_step_weight
        if args.init_lm_head not in ("random", "verifier"):
            raise ValueError(f"init_lm_head must be 'random' or 'verifier', not {args.init_lm_head!r}")
        if args.init_lm_head == "verifier":  # before the optimizer exists; a resumed checkpoint overrides it
            drafter.init_lm_head_from_verifier()
        if args.freeze_lm_head:
            drafter.freeze_lm_head()
        drafter.packed_attention = args.packed_attention
        objective = args.training_objective()
        if objective.needs_in_vocab_mass and not drafter.teacher_in_vocab_mass:
            raise ValueError(f"--objective {objective.name} needs the verifier's mass outside the draft "
                             "vocabulary: attach the teacher with model.attach_teacher(verifier, in_vocab_mass=True)")
        self.metric_steps, self.step_weight = args.ttt_steps, args.ttt_step_weight
        self._unwrapped = unwrapped

    def _drafter(self) -> Eagle3DraftModel:
        return cast("Eagle3DraftModel", self._unwrapped())

    def loss_items(self, batch_samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        plans = plan_batches(batch_samples, self.metric_steps, self._drafter().t2d)
        for batch, plan in zip(batch_samples, plans):
            batch[PLAN_KEY] = plan
        return torch.tensor(sum(plan.loss_counts[0] for plan in plans), device=device)

    def loss(self, model: nn.Module, inputs: dict[str, Any], noise: float, objective: Objective,
             stats: StepStats) -> DrafterLoss:
        drafter = self._drafter()
        step = drafter_loss(model, inputs, drafter.t2d, self.metric_steps, self.step_weight, noise,
                            objective=objective)
        assert isinstance(step.outputs.logits, tuple)  # the TTT forward returns every step's logits
        stats.update(step.outputs.logits, inputs, drafter.d2t, drafter.t2d, step.step_losses,
                     logits_mask=step.logits_mask, head_rows=step.head_rows, step_alphas=step.step_alphas)
        return step
