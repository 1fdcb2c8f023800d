"""The verifier's head without its body: the final norm and lm_head that turn an engine's last hidden state into
our post-norm state and greedy token (the engine routes and the importers need only these two tensors).

Read by tensor name through the safetensors index (checkpoint_files.py): config.json, the index, and only the
shard(s) holding the final norm and lm_head (or the tied embedding), from a directory or the Hub alike. No model
is built, so a multimodal verifier whose language model sits under `text_config` (Kimi-K2.5: model_type
kimi_k2 or kimi_k25, tensors named `language_model.model.norm.weight`) needs no class of its own and no
remote code. The norm is rebuilt from the text config (RMSNorm, Gemma's 1 + weight form, or LayerNorm when the
checkpoint holds a bias) and runs in fp32; both go to `greedy.head_device()` (the accelerator when present).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .capture import final_norm
from .family import text_config
from .greedy import head_device, head_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")
# parts of tensor names that are not the language model's own final norm or head: decoder layers (DeepSeek's
# MTP layers carry a `shared_head.norm`), vision towers, projectors
NOT_THE_HEAD = ("layers.", "layer.", "mtp", "vision", "visual", "audio", "projector", "encoder")
# families whose RMSNorm scales by (1 + weight): transformers' Gemma*RMSNorm, Qwen3-Next's zero-centred norm
ONE_PLUS_WEIGHT = ("gemma", "qwen3_next")
EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", "norm_eps")


class FinalNorm(nn.Module):
    """RMSNorm (x / rms(x) * weight, or * (1 + weight)) in fp32: the verifier's final norm, by family."""

    def __init__(self, weight: torch.Tensor, eps: float, one_plus: bool):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps, self.one_plus = float(eps), bool(one_plus)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1.0 + self.weight if self.one_plus else self.weight)


def _candidates(names: list[str], suffixes: tuple[str, ...]) -> list[str]:
    hits = [k for k in names if any(k == s or k.endswith("." + s) for s in suffixes)
            and not any(part in k for part in NOT_THE_HEAD)]
    return sorted(hits, key=lambda k: (len(k), k))


def _pick(name: str, what: str, hits: list[str]) -> str | None:
    """The one tensor for `what`: a single hit, or the language model's where several remain."""
    if len(hits) > 1:
        lm = [k for k in hits if "language_model" in k] or [k for k in hits if k.startswith("model.")]
        if len(lm) == 1:
            return lm[0]
        raise ValueError(f"{name}: several tensors could be the verifier's {what}: {hits}")
    return hits[0] if hits else None


def _config_value(top: dict[str, Any], text: dict[str, Any], key: str) -> Any:
    return text[key] if key in text else top.get(key)


# RoPE settings as checkpoints publish them (Llama-3.1's "llama3", DeepSeek-V3's and Kimi's yarn `rope_scaling`): the
# bare PretrainedConfig of transformers 5 cannot standardise them (it reads max_position_embeddings before setting
# it: AttributeError), and neither the norm nor the head uses them
ROPE_KEYS = ("rope_scaling", "rope_parameters")


def _text_config_object(text: dict[str, Any]) -> Any:
    from transformers import PretrainedConfig

    return PretrainedConfig(**{k: v for k, v in text.items() if k not in ROPE_KEYS})


def load_verifier_head(verifier: PreTrainedModel | str | Path, revision: str | None = None,
                       device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                       ) -> tuple[nn.Module, nn.Module, Any]:
    """(final norm, lm_head, text config) of a verifier. A loaded model's own modules are used as they are (they
    run where the model runs). Otherwise only those tensors are read (module docstring), the norm in fp32 and the
    head in `dtype` (default: a head stored in 16 bits in `greedy.head_dtype`, bf16 on an accelerator or a CPU with
    bf16 units, else fp32; one stored in fp32 stays fp32), both on `device` (default `greedy.head_device()`)."""
    if isinstance(verifier, nn.Module):
        return final_norm(verifier), verifier.get_output_embeddings(), text_config(verifier)
    from .checkpoint_files import CheckpointFiles

    files = CheckpointFiles(str(verifier), revision)
    top = files.config()
    text = text_config(top)
    names = list(files.weight_map())
    norm_key = _pick(files.name, "final norm", _candidates(names, tuple(f"{n}.weight" for n in NORM_NAMES)))
    if norm_key is None:
        raise ValueError(f"{files.name}: no final norm tensor (*.norm.weight, *.final_layernorm.weight, ...) in "
                         f"{files.where()}")
    head_key = _pick(files.name, "lm_head", _candidates(names, ("lm_head.weight",)))
    tied = _config_value(top, text, "tie_word_embeddings")
    if head_key is None:
        if tied is False:
            raise ValueError(f"{files.name}: no *lm_head.weight tensor in {files.where()} and its config.json has "
                             "tie_word_embeddings false: the head is its own tensor")
        head_key = _pick(files.name, "embedding", _candidates(names, ("embed_tokens.weight", "wte.weight",
                                                                      "word_embeddings.weight")))
        if head_key is None:
            raise ValueError(f"{files.name}: neither *lm_head.weight nor a tied *embed_tokens.weight in "
                             f"{files.where()}")
    where = torch.device(device) if device is not None else head_device()
    eps = next((float(text[k]) for k in EPS_KEYS if text.get(k) is not None), 1e-6)
    weight = files.tensor(norm_key)
    bias_key = norm_key[: -len("weight")] + "bias"
    norm: nn.Module
    if bias_key in files.weight_map():
        norm = nn.LayerNorm(weight.shape[0], eps=eps)
        norm.load_state_dict({"weight": weight.float(), "bias": files.tensor(bias_key).float()})
    else:
        model_type = str(text.get("model_type") or top.get("model_type") or "")
        norm = FinalNorm(weight, eps, model_type.startswith(ONE_PLUS_WEIGHT))
    head_w = files.tensor(head_key)  # [V, H]
    if dtype is None:  # a head stored in fp32 keeps it: rounding it to bf16 would change the teacher's logits
        dtype = head_dtype(where) if head_w.element_size() == 2 else torch.float32
    head_w = head_w.to(where, dtype)
    head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(head_w, requires_grad=False)
    return norm.to(where).requires_grad_(False), head, _text_config_object(text)
