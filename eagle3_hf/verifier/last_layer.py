"""The verifier's last decoder layer alone, for an engine that cannot hand out the last layer's output.

SGLang's aux capture records the residual stream *entering* a layer, so it can return index N-1 (what enters the
last layer) but never index N. Running that one layer here turns N-1 into the last layer's output, which the final
norm and head (head.py) make into our `last_hidden_state` and greedy token. The layer is transformers' own class
for the verifier's text config (the model built on the meta device: the body is never allocated), run in fp32 with
SDPA's causal attention over the one sample, positions 0..T-1: what transformers' full forward computes for an
unpadded sample.

Its tensors are read by name (checkpoint_files.py: only the shard(s) holding them) as the checkpoint stores them and
loaded through transformers' own weight conversion (the one `from_pretrained` applies): a mixture-of-experts layer
stored one tensor per expert (DeepSeek-V3, Qwen3-MoE) becomes the fused expert tensors the transformers-5 class
holds. Before anything is read, `plan_last_layer` counts the layer's parameters on the meta device and
`check_fits` refuses, in one line, a layer larger than the memory where it would run (Kimi-K2.5's is MoE: 17 B
parameters, 68 GB in fp32). Refused in one line too: a checkpoint whose last layer's tensors do not convert into the
class's (a quantized checkpoint), and a last layer with a sliding window (its mask is not the plain causal one).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .checkpoint_files import CheckpointFiles

GB = 1e9


@dataclass(frozen=True)
class LayerPlan:
    """The last layer as transformers builds it, before any tensor is read: its index, parameter count and bytes."""

    name: str  # the verifier as named
    index: int
    parameters: int
    experts: int  # routed experts (0: a dense layer)

    @property
    def fp32_bytes(self) -> int:
        return 4 * self.parameters


def _meta_model(path: str, revision: str | None, trust_remote_code: bool) -> tuple[Any, Any, nn.Module, str]:
    """(text config, the verifier's model on the meta device, its last decoder layer, that layer's name in the
    model). The model is the class `from_pretrained` would load (load_verifier's choice: the causal LM, else the
    image-text-to-text class of a verifier published with its language model nested, Kimi-K2.5), so that its
    checkpoint's names convert as they do when the whole verifier loads."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from .code_cache import one_loader_at_a_time

    with one_loader_at_a_time() if trust_remote_code else nullcontext():  # the ranks of a launch, one at a time
        config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
        auto: Any = AutoModelForCausalLM
        if (type(config) not in AutoModelForCausalLM._model_mapping
                and type(config) in AutoModelForImageTextToText._model_mapping):
            auto = AutoModelForImageTextToText
        with torch.device("meta"):  # sdpa with mask None -> is_causal: the plain causal mask of one unpadded sample
            model = auto.from_config(config, trust_remote_code=trust_remote_code, attn_implementation="sdpa")
    decoder = model.get_decoder()
    text = decoder.config
    layer = decoder.layers[int(text.num_hidden_layers) - 1]
    name = next(n for n, m in model.named_modules() if m is layer)
    return text, model, layer, name


def plan_last_layer(path: str, revision: str | None = None, trust_remote_code: bool = False,
                    name: str | None = None) -> LayerPlan:
    """The last layer's size from the verifier's config alone (its class built on the meta device, nothing read)."""
    text, _model, layer, _ = _meta_model(path, revision, trust_remote_code)
    return LayerPlan(name or path, int(text.num_hidden_layers) - 1, sum(p.numel() for p in layer.parameters()),
                     _routed_experts(layer))


def _routed_experts(layer: nn.Module) -> int:
    """How many routed experts the layer holds (its `experts` module: fused, or a list), 0 for a dense layer."""
    for name, module in layer.named_modules():
        if name.split(".")[-1] == "experts":
            count = getattr(module, "num_experts", None)
            return int(count if count is not None else len(module) if isinstance(module, nn.ModuleList) else 0)
    return 0


def free_bytes(device: torch.device) -> int:
    """Memory free where the layer would run: the GPU's free bytes (what SGLang and others left), else the
    machine's available memory (/proc/meminfo's MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_fits(plan: LayerPlan, device: torch.device, free: int | None = None) -> None:
    """One line when the layer's fp32 weights exceed the memory free on `device` (before any request)."""
    free = free_bytes(device) if free is None else free
    if plan.fp32_bytes <= free:
        return
    kind = f"a mixture of {plan.experts} experts, " if plan.experts else ""
    raise ValueError(f"{plan.name}: SGLang's route runs the verifier's last layer (layer {plan.index}) here, and it "
                     f"is {kind}{plan.parameters / 1e9:.1f} B parameters, {plan.fp32_bytes / GB:.1f} GB in fp32, more "
                     f"than the {free / GB:.1f} GB free on {device} (--device places it); for a verifier this size use "
                     "`extract --engine vllm`, whose engine returns the last layer's output itself")


class LastLayer:
    """`layer(states)`: the last decoder layer of the verifier at `path`, [T, H] entering it -> [T, H] its output
    (before the final norm), in float32 on `device`."""

    def __init__(self, path: str, revision: str | None = None, device: torch.device | str = "cpu",
                 trust_remote_code: bool = False):
        self.device = torch.device(device)
        text, model, layer, layer_name = _meta_model(path, revision, trust_remote_code)
        n = int(text.num_hidden_layers)
        kinds = getattr(text, "layer_types", None) or []
        if kinds and "sliding" in str(kinds[-1]):
            raise ValueError(f"{path}: its last layer is {kinds[-1]}; running it alone needs its sliding-window mask, "
                             "which this route does not build")
        files = CheckpointFiles(path, revision)
        mapping = _conversions(model)
        names = _stored_names(model, mapping, files.weight_map(), layer_name)
        if not names:
            raise ValueError(f"{path}: no tensor in {files.where()} loads into {layer_name} (its last layer)")
        _load_converted(model, mapping, files.tensors(names), self.device)
        unloaded = sorted(k for k, t in layer.state_dict().items() if t.is_meta)
        if unloaded:
            raise ValueError(f"{path}: its stored tensors do not give {layer_name}'s {', '.join(unloaded[:3])}"
                             f"{', ...' if len(unloaded) > 3 else ''} (a quantized checkpoint's last layer cannot be "
                             "run here)")
        self.layer = layer.float().eval().requires_grad_(False)
        decoder = model.get_decoder()
        self.rotary = type(decoder.rotary_emb)(text).to(self.device)  # computed buffers, not loaded
        self.layer_index = n - 1

    @torch.no_grad()
    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        x = states.to(self.device, torch.float32)[None]  # [1, T, H]
        positions = torch.arange(x.shape[1], device=self.device)[None]  # [1, T]
        out: Any = self.layer(x, attention_mask=None, position_ids=positions,
                              position_embeddings=self.rotary(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return out[0]  # [T, H]


def _conversions(model: Any) -> list[Any]:
    """transformers' weight conversions for `model` (renamings, expert fusions), as `from_pretrained` gets them."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))


def _stored_names(model: Any, mapping: list[Any], stored: dict[str, str], layer_name: str) -> list[str]:
    """The checkpoint's names that transformers' renaming sends into `layer_name` (names only: nothing read)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    out = []
    for key in stored:
        renamed, _ = rename_source_key(key, renamings, converters, prefix, meta)
        if renamed not in meta and key in meta:
            renamed = key  # as the loader does: a name already the model's
        if renamed.startswith(layer_name + "."):
            out.append(key)
    return out


def _load_converted(model: Any, mapping: list[Any], state: dict[str, torch.Tensor], device: torch.device
                    ) -> None:
    """`state` (stored names) into the meta `model` through transformers' weight conversion, in fp32 on `device`:
    what `from_pretrained` does, for these tensors only."""
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    convert_and_load_state_dict_in_model(model, state, LoadStateDictConfig(
        device_map={"": device}, dtype=torch.float32, weight_mapping=mapping))
