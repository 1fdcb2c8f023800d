"""DFlash's training step for the Trainer (kind_training.KindTraining): blocks at anchors drawn per micro-batch
when the step's items are counted (the same anchors at every evaluation), scored at block positions 1 .. B - 1
with weights decaying along the block (dflash_loss.py). Its head is the verifier's own, frozen, so the lm_head
options do not apply."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .dflash_loss import ANCHORS_KEY, dflash_loss, ensure_anchors, sample_anchors, step_weight

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from ..model.modeling_dflash import DFlashDraftModel
    from .arguments import DataArguments, Eagle3TrainingArguments, ModelArguments
    from .loss import DrafterLoss
    from .metrics import StepStats
    from .nodes import TrainingNodes
    from .objective import Objective
    from .training_data import TrainingFeatures


class BlockTraining:
    @staticmethod
    def build(model_args: ModelArguments, data_args: DataArguments, verifier_config: PreTrainedConfig,
              features: TrainingFeatures, nodes: TrainingNodes | None,
              ) -> tuple[DFlashDraftModel, dict[str, Any], dict[str, Any]]:
        """N Qwen3 layers drafting a block per forward over the verifier's whole vocabulary (no d2t), from scratch,
        its mask token one the data never contains."""
        from .dflash_setup import build_dflash_drafter, feature_samples

        model, init = build_dflash_drafter(model_args, verifier_config, list(features.identity.aux_layer_indices),
                                           features.identity.tokenizer_fingerprint,
                                           features.tokenizer.get("tokenizer_class"), feature_samples(features),
                                           features.tokenizer.get("chat_template_kwargs"))
        recipe = {"block_size": model_args.block_size, "dflash_layers": model_args.dflash_layers,
                  "dflash_anchors": model_args.dflash_anchors, "block_loss_decay": model_args.block_loss_decay,
                  "mask_token_id": init["mask_token_id"]}
        return model, init, recipe

    def __init__(self, drafter: DFlashDraftModel, args: Eagle3TrainingArguments,
                 unwrapped: Callable[[], nn.Module]):
        if not drafter.verifier_weights_loaded:
            raise ValueError("load the verifier's embedding and lm_head first: model.load_verifier_weights(...)")
        self.metric_steps = drafter.config.max_drafts
        self.step_weight = step_weight(drafter.config.block_loss_decay)
        self._unwrapped = unwrapped

    def _anchors_per_row(self) -> int:
        return int(cast("DFlashDraftModel", self._unwrapped()).anchors_per_row)

    def loss_items(self, batch_samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        per_row = self._anchors_per_row()
        return torch.tensor(sum(int((ensure_anchors(b, per_row) >= 0).sum()) for b in batch_samples), device=device)

    def loss(self, model: nn.Module, inputs: dict[str, Any], noise: float, objective: Objective,
             stats: StepStats) -> DrafterLoss:
        per_row = self._anchors_per_row()
        if not model.training and ANCHORS_KEY not in inputs:  # the same blocks at every evaluation
            inputs[ANCHORS_KEY] = sample_anchors(inputs, per_row, torch.Generator().manual_seed(0))
        step = dflash_loss(model, inputs, per_row, noise, objective)
        assert step.counts is not None
        stats.add(step.counts)
        return step
