"""What the Trainer asks of a drafter kind, so that it names none: each kind's row in engines/table.py points at
its `KindTraining` (EAGLE-3: chain_training.ChainTraining, DFlash: dflash_training.BlockTraining). The Trainer
keeps what is the same for every kind: accumulation, the loss normalised by the global item count, the NaN guard,
the metrics' reduction, saving."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

    from .arguments import DataArguments, Eagle3TrainingArguments, ModelArguments
    from .loss import DrafterLoss
    from .metrics import StepStats
    from .nodes import TrainingNodes
    from .objective import Objective
    from .training_data import TrainingFeatures


class KindTraining(Protocol):
    """One kind's training step. `metric_steps`: the positions its metrics count (TTT steps, block positions);
    `step_weight`: the per-position weight its logged loss is summed with."""

    metric_steps: int
    step_weight: float

    @staticmethod
    def build(model_args: ModelArguments, data_args: DataArguments, verifier_config: PreTrainedConfig,
              features: TrainingFeatures, nodes: TrainingNodes | None,
              ) -> tuple[PreTrainedModel, dict[str, Any], dict[str, Any]]:
        """(drafter, how it was initialised, the kind's own recipe fields for the training record): the training
        script's step 3, seeded before it."""

    def loss_items(self, batch_samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
        """The optimizer step's loss items (tokens or block positions), preparing each micro-batch on the way so
        that its micro-steps read the device no more."""

    def loss(self, model: nn.Module, inputs: dict[str, Any], noise: float, objective: Objective,
             stats: StepStats) -> DrafterLoss:
        """One micro-batch's loss (not yet normalised), its metric counts added to `stats`."""


def kind_training(drafter: nn.Module, args: Eagle3TrainingArguments,
                  unwrapped: Callable[[], nn.Module]) -> KindTraining:
    """The KindTraining of `drafter`'s kind (its class's `drafter_kind`); `unwrapped` returns the drafter under
    whatever wraps it (DDP, DeepSpeed) when the step runs."""
    from ..engines.table import kind

    name = getattr(drafter, "drafter_kind", None)
    if name is None:
        raise ValueError(f"{type(drafter).__name__} declares no drafter_kind: train a model class of engines/table.py")
    training: KindTraining = kind(name).training_class()(drafter, args, unwrapped)
    return training
