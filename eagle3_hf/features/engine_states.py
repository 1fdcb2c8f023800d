"""An engine's hidden-states layout -> our features: what every route fed by a serving engine shares (`extract
--engine vllm`, its OpenAI server, the feature server's client, SGLang's server, which writes the same layout).

vLLM's `extract_hidden_states` writes [T, layers, H] at ids = the aux indices + [N]: its id k < N is transformers'
`output_hidden_states` index k (the residual stream entering layer k), and id N is the last layer's output *before*
the final norm. `check_states` refuses what does not fit (one line naming where it came from and the sample);
`features_from_states` keeps the aux states as vLLM wrote them and applies the verifier's own final norm and
lm_head (with its soft-cap) here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..verifier.capture import greedy_tokens
from ..verifier.family import check_aux_indices

PROBE = 4  # samples whose next tokens must not all disagree with the captured states' greedy tokens (vLLM, SGLang)


def vllm_layer_ids(aux_indices: Sequence[int], num_layers: int) -> list[int]:
    """What vLLM is asked to capture: the aux indices (same numbers in vLLM) and N, ascending (vLLM sorts)."""
    indices = check_aux_indices(aux_indices, num_layers)
    return sorted(indices) + [num_layers]


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value is finite, in one vectorised pass in `x`'s own dtype: the smallest and the largest
    value are both finite exactly when all are (a NaN anywhere makes both NaN)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_states(data: dict[str, torch.Tensor], path: str, sample_id: str, input_ids: torch.Tensor,
                 layer_ids: list[int], hidden: int) -> torch.Tensor:
    """read_states' checks on tensors already loaded (`path` names where they came from: a file, a server)."""
    for key in ("hidden_states", "token_ids"):
        if key not in data:
            raise ValueError(f"{path}: no {key!r} tensor (sample {sample_id!r}); found {sorted(data)}")
    states, tokens = data["hidden_states"], data["token_ids"]
    if not torch.equal(tokens.long(), input_ids.long()):
        raise ValueError(f"{path}: its token_ids ({tokens.numel()}) are not sample {sample_id!r}'s input_ids "
                         f"({input_ids.numel()})")
    if states.dim() != 3 or states.shape[0] != tokens.shape[0]:
        raise ValueError(f"{path}: hidden_states has shape {tuple(states.shape)} but token_ids has {tokens.shape[0]} "
                         f"rows (sample {sample_id!r}); with prefix caching vLLM saves fewer rows: it must be off")
    if states.shape[1:] != (len(layer_ids), hidden):
        raise ValueError(f"{path}: hidden_states holds {states.shape[1]} layers x {states.shape[2]} for sample "
                         f"{sample_id!r}, expected {len(layer_ids)} (vLLM ids {layer_ids}) x hidden {hidden}")
    if not states.is_floating_point():
        raise ValueError(f"{path}: hidden_states is {states.dtype}, not floating point (sample {sample_id!r})")
    if not all_finite(states):  # only now, to name them: which layers
        finite = torch.isfinite(states).all(dim=2).all(dim=0)  # [layers]
        bad = [layer_ids[j] for j in range(len(layer_ids)) if not finite[j]]
        raise ValueError(f"{path}: non-finite hidden states for sample {sample_id!r} at vLLM layer ids {bad}")
    return states


@torch.no_grad()
def features_from_states(states: torch.Tensor, aux_indices: Sequence[int], layer_ids: list[int], norm: nn.Module,
                         head: nn.Module, softcap: float | None, dtype: torch.dtype | None = None
                         ) -> dict[str, torch.Tensor]:
    """vLLM's [T, layers, H] -> our aux_hidden_states [T, 3H] (in aux order; in `dtype`, default the states' own,
    one copy), last_hidden_state [T, H] float32 (the final norm applied once to vLLM's id N; only that layer
    is converted to float32, on the norm's device) and verifier_greedy [T], all on `states`' device. The norm and
    the head run where they live (load_verifier_head: the accelerator when there is one)."""
    slot = {lid: j for j, lid in enumerate(layer_ids)}
    t, _, h = states.shape
    aux = torch.empty(t, len(aux_indices), h, dtype=dtype or states.dtype, device=states.device)  # [T, 3, H]
    for j, i in enumerate(aux_indices):
        aux[:, j].copy_(states[:, slot[int(i)]])  # converts, where the storage dtype differs, in the same pass
    where = next(norm.parameters()).device
    last = norm(states[:, slot[layer_ids[-1]]].to(where).float())  # vLLM's id N is before the final norm
    greedy = greedy_tokens(head, last, softcap)
    return {"aux_hidden_states": aux.view(t, -1), "last_hidden_state": last.to(states.device),
            "verifier_greedy": greedy.to(states.device)}


