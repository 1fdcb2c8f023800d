"""The DFlash checkpoint layout: what vLLM's `DFlashQwen3ForCausalLM.load_weights` reads, asserted name by name.

vLLM prefixes every name but `lm_head` with `model.` and maps `q/k/v_proj` and `gate/up_proj` onto its fused
projections, so the file holds, per layer i: `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`layers.{i}.self_attn.{q,k}_norm.weight` [head_dim], `layers.{i}.mlp.{gate,up,down}_proj.weight`,
`layers.{i}.{input_layernorm,post_attention_layernorm}.weight`; and `fc.weight` [hidden, aux x target_hidden],
`hidden_norm.weight`, `norm.weight`. No `embed_tokens` or `lm_head`: without them vLLM shares the verifier's
(`llm_base_proposer._maybe_share_embeddings` / `_maybe_share_lm_head`), and an `lm_head` with fewer rows than the
vocabulary would need a `d2t` our full-vocabulary drafter has not. Saving refuses anything else, loading refuses
unknown or missing names, so a misnamed key is never served as a random layer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .checkpoint import read_safetensors_dir, resolve_checkpoint
from .configuration_dflash import DFLASH_ARCHITECTURE, DFlashConfig
from .drafter_kind import checkpoint_drafter_kind

LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight")

NOT_SERVED_PREFIXES = ("embed_tokens.", "lm_head.", "rotary_emb.")


def expected_dflash_shapes(config: DFlashConfig | Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the served layout and its shape, from the config (ours or a published config.json)."""
    c = config.to_dict() if isinstance(config, DFlashConfig) else dict(config)
    hidden = int(c["hidden_size"])
    heads, kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or hidden // heads)
    inter = int(c["intermediate_size"])
    target = int(c.get("target_hidden_size") or hidden)
    aux = len((c.get("dflash_config") or {}).get("target_layer_ids") or []) or 3
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (hidden, aux * target), "hidden_norm.weight": (hidden,),
                                          "norm.weight": (hidden,)}
    per_layer = {"self_attn.q_proj.weight": (heads * head_dim, hidden),
                 "self_attn.k_proj.weight": (kv * head_dim, hidden), "self_attn.v_proj.weight": (kv * head_dim, hidden),
                 "self_attn.o_proj.weight": (hidden, heads * head_dim),
                 "self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,),
                 "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
                 "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
                 "post_attention_layernorm.weight": (hidden,)}
    if c.get("attention_bias"):
        per_layer.update({f"self_attn.{p}_proj.bias": (n,) for p, n in
                          (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim), ("o", hidden))})
    for i in range(int(c["num_hidden_layers"])):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def layout_issues(tensors: Mapping[str, Any], config: DFlashConfig | Mapping[str, Any]) -> list[str]:
    """What keeps these tensors (name -> anything with .shape) from being the served layout: unknown, missing or
    misshapen names, one line each."""
    shapes = expected_dflash_shapes(config)
    issues = [f"unexpected tensor {k} (vLLM would refuse it or load it nowhere)"
              for k in sorted(set(tensors) - set(shapes))]
    issues += [f"missing tensor {k}" for k in shapes if k not in tensors]
    issues += [f"{k} has shape {tuple(tensors[k].shape)}, the config implies {s}"
               for k, s in shapes.items() if k in tensors and tuple(tensors[k].shape) != s]
    return issues


def served_state_dict(state_dict: Mapping[str, torch.Tensor], config: DFlashConfig) -> dict[str, torch.Tensor]:
    """The model's state dict without the verifier's weights and buffers, refused unless it is exactly the layout."""
    out = {k: v for k, v in state_dict.items() if not k.startswith(NOT_SERVED_PREFIXES)}
    issues = layout_issues(out, config)
    if issues:
        raise ValueError(f"refusing to save a DFlash drafter that vLLM would not serve: {'; '.join(issues[:6])}")
    return out


def read_dflash_checkpoint(name_or_path: str | os.PathLike,
                           revision: str | None = None) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """config and tensors of a DFlash checkpoint (a directory or Hub repo id), every name and shape asserted."""
    path: Path = resolve_checkpoint(name_or_path, revision=revision)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing")
    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    if DFLASH_ARCHITECTURE not in (raw.get("architectures") or []):
        raise ValueError(f"{path}: architectures {raw.get('architectures')} is not a DFlash drafter "
                         f"({DFLASH_ARCHITECTURE})")
    tensors = {k: v for k, v in read_safetensors_dir(path).items() if not k.startswith(NOT_SERVED_PREFIXES)}
    issues = layout_issues(tensors, raw)
    if issues:
        raise ValueError(f"{path}: {'; '.join(issues[:6])}")
    config = DFlashConfig.from_dict(raw)
    return config, tensors


def is_dflash_config(raw: Mapping[str, Any]) -> bool:
    """A config.json of a DFlash drafter: the kind its architectures declare in the drafter kinds' table
    (engines/table.py), as vLLM picks the model class."""
    from ..engines.table import DFLASH, drafter_kind

    return drafter_kind(dict(raw)) is DFLASH


def is_dflash_checkpoint(name_or_path: str | os.PathLike, revision: str | None = None) -> bool:
    """Whether a drafter directory or Hub repo holds a DFlash drafter (its config.json's architectures)."""
    from ..engines.table import DFLASH

    return checkpoint_drafter_kind(name_or_path, revision) is DFLASH
