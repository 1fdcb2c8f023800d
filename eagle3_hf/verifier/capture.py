"""Capture a verifier's EAGLE-3 features in one forward pass: three aux states, the final state, its greedy token.

Aux indices are transformers `output_hidden_states` indices: 0 = embeddings, k = output of decoder layer k-1.
That output is the residual stream entering layer k, which is what both engines capture: SGLang's
`LlamaModel.forward` (`python/sglang/srt/models/llama.py`) appends `hidden_states + residual` before
running layer i (its fused-norm layers keep the stream split in two), and vLLM captures the same sum.
For every family tested (Llama, Qwen3, DeepSeek-V3 with MLA and MoE layers, Gemma 3 whose post-attention
and post-feed-forward norms sit inside the residual branch) a transformers decoder layer returns that
sum, so one rule holds: hook the output of layer k-1. A multimodal wrapper (Kimi-K2.5) is read through
its language model's layers. They are read with forward hooks on exactly those layers, so a 61-layer verifier keeps
3 extra [T, H] tensors alive instead of 62. The final state is the decoder's `last_hidden_state` (after
the final norm) and the greedy token is the full-vocabulary argmax of the verifier's own logits, computed
through its output embedding on its device, chunked over positions and vocabulary (greedy.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .family import check_aux_indices, logit_softcap, softcap_logits, text_config
from .greedy import LOGIT_ELEMENTS_PER_CHUNK, greedy_argmax

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The verifier's list of decoder layers (`model.model.layers` for Llama-like models)."""
    num_layers = text_config(model).num_hidden_layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == num_layers:
        return layers
    for _name, module in model.named_modules():  # other layouts: the first ModuleList of the right length
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise ValueError(f"cannot find the {num_layers} decoder layers of {type(model).__name__}")


def final_norm(model: PreTrainedModel) -> nn.Module:
    """The verifier's final norm (applied to the last layer's output before the LM head)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        module = getattr(decoder, name, None)
        if isinstance(module, nn.Module):
            return module
    raise ValueError(f"cannot find the final norm of {type(model).__name__} (looked for norm, final_layernorm, ln_f)")


def _input_device(model: PreTrainedModel) -> torch.device:
    """Where input ids must go: the embedding's device (device_map-sharded models put it on the first one)."""
    weight = cast(torch.Tensor, model.get_input_embeddings().weight)
    return torch.device("cpu") if weight.device.type == "meta" else weight.device


@torch.no_grad()
def greedy_tokens(model_or_head: nn.Module, last_hidden_state: torch.Tensor,
                  softcap: float | None = None) -> torch.Tensor:
    """Full-vocabulary argmax of lm_head(h) per position, on the head's device: [T, H] -> int64 [T] (greedy.py).

    `model_or_head` is a causal LM (its output embedding and `final_logit_softcapping` are used) or a bare
    head module (then pass `softcap`). Soft-capping is monotonic, so it is applied only to stay faithful.
    A bf16 head gives the fp32 token except at numerical ties (greedy.greedy_argmax rescores in fp32).
    """
    head = model_or_head
    get_output_embeddings = getattr(model_or_head, "get_output_embeddings", None)
    if get_output_embeddings is not None:
        head = get_output_embeddings()
        softcap = logit_softcap(model_or_head)
    weight = cast(torch.Tensor, head.weight)
    if getattr(head, "bias", None) is not None or weight.device.type == "meta":
        # a head with a bias (rare), or offloaded by accelerate (its hook brings the weight in): its own forward
        vocab = weight.shape[0]
        chunk = max(1, LOGIT_ELEMENTS_PER_CHUNK // vocab)
        out = [softcap_logits(head(last_hidden_state[s:s + chunk]), softcap).argmax(-1).to(last_hidden_state.device)
               for s in range(0, last_hidden_state.shape[0], chunk)]
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=last_hidden_state.device)
    return greedy_argmax(weight, last_hidden_state, softcap)


@contextmanager
def capture_layer_outputs(model: PreTrainedModel, aux_indices: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks on the decoder layers behind `aux_indices`: while active, every forward of `model`
    leaves the outputs of those layers ([B, T, H], by output_hidden_states index) in the yielded dict."""
    indices = check_aux_indices(aux_indices, text_config(model).num_hidden_layers)
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}

    def hook_for(index: int) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output  # [B, T, H]

        return hook

    handles = [layers[i - 1].register_forward_hook(hook_for(i)) for i in indices]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def decoder_of(model: PreTrainedModel) -> PreTrainedModel:
    """The base decoder (no LM head): its `last_hidden_state` is the post-norm final state."""
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    return cast("PreTrainedModel", model.model)


def aux_from(captured: dict[int, torch.Tensor], indices: Sequence[int]) -> torch.Tensor:
    """The captured layer outputs concatenated in index order: [..., 3H]."""
    missing = [i for i in indices if i not in captured]
    if missing:
        raise RuntimeError(f"hooks on decoder layers for aux indices {missing} did not fire")
    return torch.cat([captured[i] for i in indices], dim=-1)


@torch.no_grad()
def capture_features(
    model: PreTrainedModel, input_ids: torch.Tensor, aux_indices: Sequence[int],
    out_device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Run the verifier once on one sequence and return its EAGLE-3 features, in the verifier's dtype.

    input_ids: LongTensor [T] or [1, T]. Returns aux_hidden_states [T, 3H] (concatenated in index order),
    last_hidden_state [T, H] (post-norm) and verifier_greedy int64 [T], all on `out_device` (default: the
    device of the final hidden state).
    """
    indices = check_aux_indices(aux_indices, text_config(model).num_hidden_layers)
    ids = input_ids.reshape(1, -1).to(_input_device(model), dtype=torch.long)  # [1, T]
    with capture_layer_outputs(model, indices) as captured:
        out = decoder_of(model)(input_ids=ids, use_cache=False)
    last = out.last_hidden_state[0]  # [T, H], after the final norm
    device = torch.device(out_device) if out_device is not None else last.device
    aux = aux_from({i: captured[i][0].to(device) for i in captured}, indices)  # [T, 3H]
    greedy = greedy_tokens(model, last)
    return {"aux_hidden_states": aux, "last_hidden_state": last.to(device), "verifier_greedy": greedy.to(device)}
