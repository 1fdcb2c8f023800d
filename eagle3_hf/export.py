"""Checkpoint layouts: what SGLang and vLLM load, what other tools publish, and the speculators layout.

The standard EAGLE-3 layout (DESIGN.md §3) is the contract that matters most: SGLang drops unknown weight
names *silently*, so a misnamed key serves a random layer at τ ≈ 1. Every conversion here therefore checks
that each name and shape lines up and says which one failed. `eagle3-hf export` writes either layout.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .configuration_eagle3 import Eagle3Config, aux_indices_from_config

EMBED_KEY = "embed_tokens.weight"
SPECULATORS_VERSION = "0.9.0"
_IGNORED_PREFIXES = ("verifier_", "rotary_emb.")  # speculators' frozen verifier copies, rope buffers


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the standard layout and its shape, derived from the config alone."""
    h, t = config.hidden_size, config.target_hidden_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    shapes = {
        "midlayer.self_attn.q_proj.weight": (q_out, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv_out, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv_out, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q_out),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "fc.weight": (h, 3 * t),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
        "d2t": (config.draft_vocab_size,),
        "t2d": (config.vocab_size,),
    }
    if config.attention_bias:
        shapes.update({f"midlayer.self_attn.{p}_proj.bias": (shapes[f"midlayer.self_attn.{p}_proj.weight"][0],)
                       for p in "qkvo"})
    return shapes


def validate_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """d2t holds offsets (target = i + d2t[i]), strictly increasing targets, t2d true exactly there."""
    if tuple(d2t.shape) != (draft_vocab_size,) or tuple(t2d.shape) != (vocab_size,):
        raise ValueError(
            f"vocabulary mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
            f"draft_vocab_size {draft_vocab_size} and vocab_size {vocab_size}"
        )
    targets = torch.arange(draft_vocab_size, dtype=torch.long) + d2t.cpu().long()
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab_size):
        raise ValueError("d2t maps draft ids outside the verifier vocabulary (d2t must hold offsets, not ids)")
    if targets.numel() > 1 and not bool((targets[1:] > targets[:-1]).all()):
        raise ValueError("d2t targets are not strictly increasing: kept ids must be sorted and unique")
    expected = torch.zeros(vocab_size, dtype=torch.bool)
    expected[targets] = True
    if not torch.equal(expected, t2d.cpu().bool()):
        raise ValueError(
            f"d2t and t2d disagree: t2d marks {int(t2d.sum())} ids, d2t maps to {draft_vocab_size}; "
            f"{int((expected != t2d.cpu().bool()).sum())} ids differ"
        )


def standard_state_dict(
    state_dict: dict[str, torch.Tensor], config: Eagle3Config, include_embed_tokens: bool = False
) -> dict[str, torch.Tensor]:
    """Exactly the standard layout's tensors, checked against the config; refuses what cannot serve."""
    shapes = expected_shapes(config)
    out: dict[str, torch.Tensor] = {}
    missing = [k for k in shapes if k not in state_dict]
    if "lm_head.weight" in missing:
        raise ValueError("refusing to write a drafter without lm_head.weight: SGLang would serve a random head")
    if missing:
        raise ValueError(f"refusing to write a drafter missing {missing}")
    for key, shape in shapes.items():
        tensor = state_dict[key]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"refusing to write {key} with shape {tuple(tensor.shape)}: the config implies {shape}")
        out[key] = tensor
    validate_vocab_mapping(out["d2t"], out["t2d"], config.draft_vocab_size, config.vocab_size)
    out["d2t"], out["t2d"] = out["d2t"].long(), out["t2d"].bool()
    if include_embed_tokens:
        embed = state_dict.get(EMBED_KEY)
        if embed is None or tuple(embed.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"{EMBED_KEY} missing or not [vocab_size, hidden_size]")
        out[EMBED_KEY] = embed
    return out


# ---------------------------------------------------------------- reading any published layout

def resolve_checkpoint(name_or_path: str | os.PathLike, revision: str | None = None, token=None,
                       cache_dir: str | None = None) -> Path:
    """A local directory, or a Hub repo id downloaded (config, weights, card) at `revision`."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint directory")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), revision=revision, token=token, cache_dir=cache_dir,
                                  allow_patterns=["*.json", "*.safetensors", "README.md"]))


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded with an index)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors file (only safetensors checkpoints are read)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in tensors:
                    raise ValueError(f"{key} appears in more than one file of {path}")
                tensors[key] = f.get_tensor(key)
    return tensors


def is_speculators_config(config: dict[str, Any]) -> bool:
    return "speculators_model_type" in config or "transformer_layer_config" in config


def config_from_published(raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Eagle3Config:
    """Eagle3Config from a standard-layout config (ours, LlamaForCausalLM, kimi_k2, ...) or a speculators one."""
    if is_speculators_config(raw):
        layer = dict(raw["transformer_layer_config"])
        verifier = (raw.get("speculators_config") or {}).get("verifier") or {}
        fields = dict(layer)
        fields.update(
            draft_vocab_size=raw.get("draft_vocab_size"),
            target_hidden_size=raw.get("target_hidden_size") or layer.get("hidden_size"),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            verifier_name_or_path=verifier.get("name_or_path"),
        )
        ids = raw.get("eagle_aux_hidden_state_layer_ids")  # speculators/vLLM: output_hidden_states indices
        if ids:
            fields["aux_hidden_state_indices"] = list(ids)
    else:
        fields = dict(raw)
        fields["aux_hidden_state_indices"] = raw.get("aux_hidden_state_indices") or aux_indices_from_config(raw)
        fields.pop("eagle_config", None)
        fields.pop("eagle_aux_hidden_state_layer_ids", None)
    for key in ("model_type", "architectures", "transformers_version", "auto_map", "torch_dtype", "dtype",
                "quantization_config", "_name_or_path", "speculators_model_type", "speculators_version"):
        fields.pop(key, None)
    if not fields.get("draft_vocab_size"):
        if "lm_head.weight" not in tensors:
            raise ValueError("checkpoint has neither draft_vocab_size in config.json nor lm_head.weight")
        fields["draft_vocab_size"] = tensors["lm_head.weight"].shape[0]
    if not fields.get("target_hidden_size") and "fc.weight" in tensors:
        fields["target_hidden_size"] = tensors["fc.weight"].shape[1] // 3
    # rope: legacy keys become rope_parameters unless a transformers-5 block exists
    if not fields.get("rope_parameters"):
        scaling = dict(fields.pop("rope_scaling", None) or {})
        if "type" in scaling:
            scaling.setdefault("rope_type", scaling.pop("type"))
        scaling.setdefault("rope_type", "default")
        scaling["rope_theta"] = fields.pop("rope_theta", 10000.0)
        fields["rope_parameters"] = scaling
    return Eagle3Config(**{k: v for k, v in fields.items() if v is not None or k == "pad_token_id"})


def standard_names(tensors: dict[str, torch.Tensor], speculators: bool) -> dict[str, torch.Tensor]:
    """Rename speculators' `layers.0.*` to `midlayer.*`; drop only names known to be irrelevant."""
    out = {}
    for key, tensor in tensors.items():
        if key.startswith(_IGNORED_PREFIXES):
            continue
        if speculators and key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0."):]
        out[key] = tensor
    return out


def load_drafter(cls, name_or_path, *args, verifier=None, revision: str | None = None, token=None,
                 dtype=None, torch_dtype=None, attn_implementation: str | None = None,
                 cache_dir: str | None = None, device: str | None = None, **kwargs):
    """Load any supported layout into `cls`, asserting every name and shape lines up."""
    if args:
        raise TypeError(f"unexpected positional arguments {args}")
    kwargs.pop("trust_remote_code", None)  # never needed: the drafter's code is this file
    if kwargs:
        raise TypeError(f"unsupported from_pretrained arguments: {sorted(kwargs)}")
    path = resolve_checkpoint(name_or_path, revision=revision, token=token, cache_dir=cache_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing")
    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    speculators = is_speculators_config(raw)
    tensors = standard_names(read_safetensors_dir(path), speculators)
    config = config_from_published(raw, tensors)
    config._attn_implementation = attn_implementation or "sdpa"
    if "d2t" not in tensors and "t2d" not in tensors and config.draft_vocab_size == config.vocab_size:
        tensors["d2t"] = torch.zeros(config.vocab_size, dtype=torch.long)  # full vocabulary: identity
        tensors["t2d"] = torch.ones(config.vocab_size, dtype=torch.bool)
    shapes = expected_shapes(config)
    allowed = set(shapes) | {EMBED_KEY}
    unknown = sorted(set(tensors) - allowed)
    if unknown:
        raise ValueError(f"{path}: unexpected tensors {unknown[:8]} (an engine would drop them silently)")
    missing = [k for k in shapes if k not in tensors]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    for key, shape in shapes.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{path}: {key} has shape {tuple(tensors[key].shape)}, config implies {shape}")
    validate_vocab_mapping(tensors["d2t"], tensors["t2d"], config.draft_vocab_size, config.vocab_size)

    model = cls(config)
    has_embed = EMBED_KEY in tensors
    result = model.load_state_dict(tensors, strict=False)
    if result.unexpected_keys or [k for k in result.missing_keys if k != EMBED_KEY]:
        raise ValueError(f"{path}: state dict mismatch {result}")
    model.embed_tokens_loaded = has_embed
    if verifier is not None:
        model.load_verifier_embeddings(verifier)
    target_dtype = dtype or torch_dtype
    if isinstance(target_dtype, str) and target_dtype != "auto":
        target_dtype = getattr(torch, target_dtype)
    if isinstance(target_dtype, torch.dtype):
        model.to(target_dtype)
    if device is not None:
        model.to(device)
    model.eval()
    model.source_layout = "speculators" if speculators else "standard"
    return model


# ---------------------------------------------------------------- writing the speculators layout

def speculators_config(config: Eagle3Config, verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    """config.json of the speculators layout (vLLM loads it; speculators' own tools read it)."""
    layer = {k: v for k, v in config.to_dict().items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
        "attention_bias", "mlp_bias", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")}
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
                 architectures=["LlamaForCausalLM"])
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "norm_before_residual": bool(config.norm_before_residual),  # vLLM defaults it to true when missing
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_hidden_state_indices or []),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(config.ttt_steps),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": config.verifier_name_or_path,
                         "architectures": verifier_architectures or ["LlamaForCausalLM"]},
        },
    }


def save_speculators(model, out_dir: str | os.PathLike, verifier=None) -> Path:
    """Write the speculators layout: `layers.0.*` names and the verifier's embedding included
    (speculators' loader leaves a missing embedding at zero; vLLM shares identical ones)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if verifier is not None:
        model.load_verifier_embeddings(verifier)
    model._check_embeddings()
    state = standard_state_dict(model.state_dict(), model.config, include_embed_tokens=True)
    renamed = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v.contiguous()
               for k, v in state.items()}
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    architectures = list(getattr(getattr(verifier, "config", None), "architectures", None) or []) or None
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(speculators_config(model.config, architectures), f, indent=2)
    return out


# ---------------------------------------------------------------- `eagle3-hf export`

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="drafter directory or Hub repo id (any supported layout)")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--format", choices=["standard", "speculators"], default="standard")
    parser.add_argument("--verifier", help="verifier (name or path): its embedding fills embed_tokens")
    parser.add_argument("--include-embed-tokens", action="store_true",
                        help="standard layout: also write embed_tokens (engines normally take the verifier's)")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16", "float16"])


def run(args: argparse.Namespace) -> int:
    from .assets import load_verifier
    from .modeling_eagle3 import Eagle3DraftModel

    verifier = load_verifier(args.verifier) if args.verifier else None
    model = Eagle3DraftModel.from_pretrained(args.drafter, revision=args.revision, verifier=verifier,
                                             dtype=args.dtype)
    if args.format == "speculators":
        if verifier is None and not model.embed_tokens_loaded:
            raise SystemExit("--format speculators needs --verifier (the layout carries the verifier's embedding)")
        save_speculators(model, args.output, verifier=verifier)
    else:
        model.save_pretrained(args.output, include_embed_tokens=args.include_embed_tokens)
    print(f"wrote the {args.format} layout to {args.output}")
    return 0
