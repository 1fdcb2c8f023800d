"""Muon for the drafter's 2-D hidden weights, AdamW for the rest, behind one optimizer object.

Muon orthogonalises each matrix update (Newton–Schulz), which suits the hidden projections (attention,
MLP, `fc`); embeddings, `lm_head` and norms are not hidden matrices and keep AdamW. The Trainer and its LR
scheduler expect one optimizer: `HybridMuonAdamW` shares the two optimizers' parameter groups, so the
scheduler's per-group lr reaches both, and checkpoints hold both states. Muon's update is scaled to match
AdamW's RMS (`adjust_lr_fn="match_rms_adamw"`), so one learning rate serves both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def muon_param_names(model: torch.nn.Module) -> set[str]:
    """Trainable 2-D weights of the hidden layers: everything matrix-shaped but the embedding and lm_head."""
    return {name for name, p in model.named_parameters()
            if p.requires_grad and p.ndim == 2 and not name.startswith(("embed_tokens", "lm_head"))}


class HybridMuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on `muon_params`, torch.optim.AdamW on `adamw_params`."""

    def __init__(self, muon_params: Iterable[torch.Tensor], adamw_params: Iterable[torch.Tensor], lr: float,
                 weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 momentum: float = 0.95):
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        self.optimizers: list[torch.optim.Optimizer] = []
        if muon_params:
            self.optimizers.append(torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay,
                                                    momentum=momentum, adjust_lr_fn="match_rms_adamw"))
        if adamw_params:
            self.optimizers.append(torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay,
                                                     betas=betas, eps=eps))
        super().__init__([p for o in self.optimizers for g in o.param_groups for p in g["params"]], {"lr": lr})
        # one list of the sub-optimizers' own group dicts: a scheduler writing group["lr"] reaches them
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @torch.no_grad()
    # torch declares step as two overloads (with and without a closure); this one signature covers both
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            optimizer.load_state_dict(state)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


def build_hybrid_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                           betas: tuple[float, float], eps: float) -> HybridMuonAdamW:
    names = muon_param_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return HybridMuonAdamW([p for n, p in params if n in names], [p for n, p in params if n not in names],
                           lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
