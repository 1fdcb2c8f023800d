"""The drafter checkpoint: its layout, its shapes, its vocabulary mapping, and reading / writing it.

The bottom of the house (it imports only the configuration): the model's `save_pretrained` /
`from_pretrained`, `eagle3-hf export`, `eagle3-hf check`, the trainer's metrics and the vocabulary builder
all use the definitions here, so a rule is written once. docs/contracts.md describes the contract for users.

Standard layout (what SGLang and vLLM load): one `model.safetensors` with exactly the names of
`expected_shapes` (no `model.` prefix, the decoder layer as `midlayer.*`), plus `config.json` from
`Eagle3Config`. SGLang drops unknown weight names *silently*, so a misnamed key serves a random layer at
τ ≈ 1: every conversion here checks that each name and shape lines up and says which one failed.

Vocabulary mapping: draft id i (a row of `lm_head`) proposes verifier id `i + d2t[i]` (`d2t` int64
[draft_vocab_size] holds *offsets*, as both engines read it); `t2d` bool [vocab_size] marks the verifier ids
the drafter can propose. Kept ids are unique and stored ascending. `draft_to_target`, `target_to_draft`
and `vocab_from_target_ids` are the only places that do this arithmetic.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..verifier.family import aux_indices_from_config, text_config
from .configuration_eagle3 import Eagle3Config

if TYPE_CHECKING:
    import numpy as np

EMBED_KEY = "embed_tokens.weight"
LAYER_WEIGHTS = (  # every weight of the standard layout, in the order errors list them
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight",
)
INPUT_NORM_KEY = "input_norm.weight"  # EAGLE 3.1 norm_before_fc: [3 x target_hidden], vLLM's and speculators' name
FC_NORM_KEYS = tuple(f"fc_norm.{i}.weight" for i in range(3))  # EAGLE 3.1 fc_norm: [target_hidden] per aux state
EAGLE31_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")
VOCAB_BUFFERS = ("d2t", "t2d")
BIAS_WEIGHTS = tuple(f"midlayer.self_attn.{p}_proj.bias" for p in "qkvo")  # only with attention_bias
SPECULATORS_VERSION = "0.9.0"
_IGNORED_PREFIXES = ("verifier_", "rotary_emb.")  # speculators' frozen verifier copies, rope buffers


def expected_shapes(config: Eagle3Config | Mapping[str, Any],
                    include_embed_tokens: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor of the standard layout and its shape, derived from the config alone.

    `config` is an `Eagle3Config` or a raw `config.json` dict (what `check` reads); a dict may omit the
    keys with a Llama default (num_key_value_heads, head_dim, target_hidden_size, draft_vocab_size).
    Raises KeyError / TypeError / ValueError when a size is missing or not an integer.
    """
    get: Callable[[str], Any] = config.get if isinstance(config, Mapping) else (lambda key: getattr(config, key, None))
    h = int(get("hidden_size"))
    t = int(get("target_hidden_size") or h)
    heads = int(get("num_attention_heads"))
    kv = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or h // heads)
    inter, vocab = int(get("intermediate_size")), int(get("vocab_size"))
    draft_vocab = int(get("draft_vocab_size") or vocab)
    q_out, kv_out = heads * head_dim, kv * head_dim
    shapes = dict(zip(LAYER_WEIGHTS, [
        (q_out, 2 * h), (kv_out, 2 * h), (kv_out, 2 * h), (h, q_out),  # q/k/v read cat(embedding, hidden)
        (inter, h), (inter, h), (h, inter),
        (h,), (h,), (h,),
        (h, 3 * t),  # fc: three aux hidden states of the verifier -> hidden
        (h,),
        (draft_vocab, h),
    ]))
    shapes.update({"d2t": (draft_vocab,), "t2d": (vocab,)})
    options = eagle31_options(config if isinstance(config, Mapping) else
                              {key: getattr(config, key, False) for key in EAGLE31_OPTIONS})
    if options["norm_before_fc"]:
        shapes[INPUT_NORM_KEY] = (3 * t,)
    if options["fc_norm"]:
        shapes.update({key: (t,) for key in FC_NORM_KEYS})
    if get("attention_bias"):
        shapes.update({bias: (shapes[bias.replace(".bias", ".weight")][0],) for bias in BIAS_WEIGHTS})
    if include_embed_tokens:
        shapes[EMBED_KEY] = (vocab, h)
    return shapes


def eagle31_options(raw: Mapping[str, Any]) -> dict[str, bool]:
    """The EAGLE 3.1 options of a config.json (any layout), read as vLLM reads them: `norm_before_fc` from
    `eagle_config` first, then the top level (`llama_eagle3.py`); `fc_norm` and `norm_output` from the top level."""
    eagle = raw.get("eagle_config")
    nested: Mapping[str, Any] = eagle if isinstance(eagle, Mapping) else {}
    return {"norm_before_fc": bool(nested.get("norm_before_fc", raw.get("norm_before_fc", False))),
            "fc_norm": bool(raw.get("fc_norm", False)), "norm_output": bool(raw.get("norm_output", False))}


# ---------------------------------------------------------------- the vocabulary mapping (d2t / t2d)

def draft_to_target(d2t: torch.Tensor, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Verifier ids of `draft_ids` (default: of every draft id, in draft order): i + d2t[i]."""
    if draft_ids is None:
        return torch.arange(d2t.numel(), dtype=torch.long, device=d2t.device) + d2t.long()
    return draft_ids + d2t[draft_ids]


def target_to_draft(d2t: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """Draft ids of verifier ids `target_ids`, -1 where the draft vocabulary lacks the token."""
    targets = draft_to_target(d2t).to(target_ids.device)
    if targets.numel() == 0:
        return torch.full_like(target_ids, -1)
    rows = torch.searchsorted(targets, target_ids).clamp(max=targets.numel() - 1)  # targets are ascending
    return torch.where(targets[rows] == target_ids, rows, torch.full_like(rows, -1))


def vocab_from_target_ids(kept_ids: torch.Tensor | np.ndarray | Sequence[int],
                          vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [N], t2d bool [vocab_size]) for a set of kept verifier ids (any order)."""
    kept = torch.as_tensor(kept_ids, dtype=torch.int64).flatten().sort().values
    if kept.numel() == 0 or kept.unique().numel() != kept.numel():
        raise ValueError("kept ids must be non-empty and distinct")
    if kept[0] < 0 or kept[-1] >= vocab_size:
        raise ValueError(f"kept ids must lie in 0..{vocab_size - 1}")
    d2t = kept - torch.arange(kept.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


@dataclass(frozen=True)
class VocabIssue:
    """One way a d2t / t2d pair is wrong. `level` is how `check` reports it; `refused` whether this
    package refuses to install, save or load such a mapping (it also insists on sorted ids)."""

    level: str  # "error" | "warning"
    code: str
    message: str
    refused: bool


def vocab_mapping_issues(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab_size: int) -> list[VocabIssue]:
    """Everything wrong with a mapping for a verifier of `vocab_size`; `t2d` may be absent (None)."""
    d2t = d2t.cpu().long()
    targets = draft_to_target(d2t)
    t2d = None if t2d is None or t2d.numel() != vocab_size else t2d.cpu().bool()
    looks_absolute = bool(d2t.numel() > 1 and (d2t[1:] > d2t[:-1]).all() and d2t.min() >= 0
                          and d2t.max() < vocab_size)
    if t2d is not None and looks_absolute and torch.equal(t2d.nonzero().flatten(), d2t):
        return [VocabIssue("error", "d2t-absolute", "d2t holds absolute verifier ids (t2d marks exactly d2t's "
                           "values): engines compute target = i + d2t[i] (SGLang hot_token_id = d2t + arange, vLLM "
                           "the same), so every draft id lands on the wrong token; store offsets d2t[i] = kept[i] - i",
                           True)]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        hint = "; d2t looks like absolute ids" if looks_absolute else ""
        return [VocabIssue("error", "d2t-range", f"d2t maps draft ids outside the verifier vocabulary: i + d2t[i] "
                           f"reaches {int(targets.max())} (min {int(targets.min())}), vocabulary size {vocab_size} "
                           f"(d2t must hold offsets d2t[i] = kept[i] - i, not ids{hint})", True)]
    issues = []
    if targets.numel() > 1 and not bool((targets[1:] > targets[:-1]).all()):
        dup = targets.numel() - targets.unique().numel()
        issues.append(VocabIssue("error" if dup else "warning", "d2t-order",
                                 f"d2t targets i + d2t[i] are not strictly increasing ({dup} duplicate targets): "
                                 "kept ids must be unique and sorted, as the standard layout stores them", True))
    if d2t.numel() and not bool(d2t.any()) and d2t.numel() < vocab_size:
        issues.append(VocabIssue("warning", "d2t-identity", "d2t is all zeros: draft id i maps to verifier id i, "
                                 "i.e. the draft vocabulary is the first draft_vocab_size ids; usually a forgotten "
                                 "mapping", False))
    if t2d is not None:
        expected = torch.zeros(vocab_size, dtype=torch.bool)
        expected[targets] = True
        if not torch.equal(expected, t2d):
            issues.append(VocabIssue("error", "d2t-t2d-mismatch", f"d2t and t2d disagree: t2d marks {int(t2d.sum())} "
                                     f"ids, d2t maps to {d2t.numel()} (i + d2t[i] marks {int(expected.sum())}); "
                                     f"{int((expected != t2d).sum())} ids differ: the draft vocabulary mapping is "
                                     "inconsistent", True))
    return issues


def validate_vocab_mapping(d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int) -> None:
    """Refuse a mapping of the wrong shapes or with any issue `vocab_mapping_issues` marks refused."""
    if tuple(d2t.shape) != (draft_vocab_size,) or tuple(t2d.shape) != (vocab_size,):
        raise ValueError(
            f"vocabulary mapping shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)} do not match "
            f"draft_vocab_size {draft_vocab_size} and vocab_size {vocab_size}"
        )
    refused = [issue for issue in vocab_mapping_issues(d2t, t2d, vocab_size) if issue.refused]
    if refused:
        raise ValueError(refused[0].message)


# ---------------------------------------------------------------- the standard layout

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
    if config.draft_vocab_size == config.vocab_size:  # the whole vocabulary: no mapping, and vLLM refuses one
        del out["d2t"], out["t2d"]
    if include_embed_tokens:
        embed = state_dict.get(EMBED_KEY)
        if embed is None or tuple(embed.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"{EMBED_KEY} missing or not [vocab_size, hidden_size]")
        out[EMBED_KEY] = embed
    return out


# ---------------------------------------------------------------- reading any published layout

def resolve_checkpoint(name_or_path: str | os.PathLike, revision: str | None = None, token: str | bool | None = None,
                       cache_dir: str | None = None) -> Path:
    """A local directory, or a Hub repo id downloaded (config, weights, card) at `revision`."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; pass the checkpoint directory")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(name_or_path)):  # a path, not a repo id: say so
        raise FileNotFoundError(f"{name_or_path} is neither a checkpoint directory nor a Hub repo id")
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
            **eagle31_options(raw),  # speculators writes the three at the top level (vLLM's algos.py reads them)
        )
        ids = raw.get("eagle_aux_hidden_state_layer_ids")  # speculators/vLLM: output_hidden_states indices
        if ids:
            fields["aux_hidden_state_indices"] = list(ids)
    else:
        fields = dict(raw)
        fields["aux_hidden_state_indices"] = raw.get("aux_hidden_state_indices") or aux_indices_from_config(raw)
        fields.update(eagle31_options(raw))  # norm_output carries no weight: only the config says the recurrence
        fields.pop("eagle_config", None)
        fields.pop("eagle_aux_hidden_state_layer_ids", None)
    if fields.get("sliding_window") is not None and fields.get("layer_types") is None:
        fields.pop("sliding_window")  # vLLM's Llama drafter applies a window only where layer_types marks it
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


def refuse_non_drafter(name: str | os.PathLike, path: Path, raw: dict[str, Any]) -> None:
    """Name a checkpoint that is not a drafter at all (a verifier, say) from tensor names alone: every
    EAGLE-3 layout has `fc.weight`, the projection of the verifier's features. Reads no tensor data."""
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    if not names or "fc.weight" in names:
        return  # no weights: read_safetensors_dir says so
    text = text_config(raw)
    layers = text.get("num_hidden_layers")
    arch = (raw.get("architectures") or [raw.get("model_type") or "model"])[0]
    what = f"a {layers}-layer {arch}" if layers else arch
    raise ValueError(f"{name} is not an EAGLE-3 drafter (it is {what}): a drafter has fc.weight and midlayer.*")


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A drafter checkpoint read and checked: where it lies, its config, its tensors under the standard names
    (the identity mapping filled in for a full vocabulary), and which layout it came in."""

    path: Path
    config: Eagle3Config
    tensors: dict[str, torch.Tensor]
    layout: str  # "standard" | "speculators"


def read_drafter_checkpoint(name_or_path: str | os.PathLike, revision: str | None = None,
                            token: str | bool | None = None, cache_dir: str | None = None) -> DrafterCheckpoint:
    """Read any supported layout, asserting every name and shape lines up (`Eagle3DraftModel.from_pretrained`
    builds the model from it)."""
    path = resolve_checkpoint(name_or_path, revision=revision, token=token, cache_dir=cache_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} is missing")
    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    if "DFlashDraftModel" in (raw.get("architectures") or []):  # model/dflash_checkpoint.py reads those
        raise ValueError(f"{name_or_path} is a DFlash drafter, not an EAGLE-3 one: load it with DFlashDraftModel "
                         "(`evaluate`, `check` and `export --format gguf` take it as it is)")
    speculators = is_speculators_config(raw)
    refuse_non_drafter(name_or_path, path, raw)
    tensors = standard_names(read_safetensors_dir(path), speculators)
    config = config_from_published(raw, tensors)
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
    return DrafterCheckpoint(path, config, tensors, "speculators" if speculators else "standard")


# ---------------------------------------------------------------- writing the speculators layout

def speculators_config(config: Eagle3Config, verifier_architectures: list[str] | None = None) -> dict[str, Any]:
    """config.json of the speculators layout (vLLM loads it; speculators' own tools read it)."""
    layer = {k: v for k, v in config.to_dict().items() if k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
        "attention_bias", "mlp_bias", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
        "sliding_window", "layer_types", "use_sliding_window")}  # the window where speculators writes it
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
        **config.eagle31_options(),  # vLLM's algos.py reads all three (default false)
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


def write_speculators(state_dict: dict[str, torch.Tensor], config: Eagle3Config, out_dir: str | os.PathLike,
                      verifier_architectures: list[str] | None = None) -> Path:
    """Write a drafter's state dict (embed_tokens included) in the speculators layout: `layers.0.*` names."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = standard_state_dict(state_dict, config, include_embed_tokens=True)
    renamed = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v.contiguous()
               for k, v in state.items()}
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    with open(out / "config.json", "w", encoding="utf-8") as f:
        json.dump(speculators_config(config, verifier_architectures), f, indent=2)
    return out
