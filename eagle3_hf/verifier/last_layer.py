"""The verifier's last decoder layer alone, for an engine that cannot hand out the last layer's output.

SGLang's aux capture records the residual stream *entering* a layer, so it can return index N-1 (what enters the
last layer) but never index N. Running that one layer here turns N-1 into the last layer's output, which the final
norm and head (head.py) make into our `last_hidden_state` and greedy token. The layer is transformers' own class
for the verifier's text config (built on the meta device: the body is never allocated), its tensors read by name
(checkpoint_files.py: only the shard(s) holding them), run in fp32 with SDPA's causal attention over the one
sample, positions 0..T-1: what transformers' full forward computes for an unpadded sample.

Refused in one line: a checkpoint whose last layer's tensors are not the ones the class holds (a quantized
checkpoint), and a last layer with a sliding window (its mask is not the plain causal one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .checkpoint_files import CheckpointFiles


class LastLayer:
    """`layer(states)`: the last decoder layer of the verifier at `path`, [T, H] entering it -> [T, H] its output
    (before the final norm), in float32 on `device`."""

    def __init__(self, path: str, revision: str | None = None, device: torch.device | str = "cpu",
                 trust_remote_code: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = torch.device(device)
        config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
        text = config.get_text_config()
        text._attn_implementation = "sdpa"  # mask None -> is_causal: the plain causal mask of one unpadded sample
        n = int(text.num_hidden_layers)
        kinds = getattr(text, "layer_types", None) or []
        if kinds and "sliding" in str(kinds[-1]):
            raise ValueError(f"{path}: its last layer is {kinds[-1]}; running it alone needs its sliding-window mask, "
                             "which this route does not build")
        with torch.device("meta"):
            body = AutoModelForCausalLM.from_config(text, trust_remote_code=trust_remote_code).base_model
        layer: nn.Module = body.layers[n - 1]
        wanted = set(layer.state_dict())
        files = CheckpointFiles(path, revision)
        prefix = _prefix(files.weight_map(), n - 1, wanted)
        if prefix is None:
            raise ValueError(f"{path}: no tensors named *layers.{n - 1}.{{{', '.join(sorted(wanted)[:3])}, ...}} in "
                             f"{files.where()} (a quantized checkpoint's last layer cannot be run here)")
        layer.to_empty(device=self.device)
        layer.load_state_dict({k: files.tensor(prefix + k).float() for k in wanted}, strict=True)
        self.layer = layer.float().eval().requires_grad_(False)
        self.rotary = type(body.rotary_emb)(text).to(self.device)  # built here: its buffers are computed, not loaded
        self.layer_index = n - 1

    @torch.no_grad()
    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        x = states.to(self.device, torch.float32)[None]  # [1, T, H]
        positions = torch.arange(x.shape[1], device=self.device)[None]  # [1, T]
        out: Any = self.layer(x, attention_mask=None, position_ids=positions,
                              position_embeddings=self.rotary(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        return out[0]  # [T, H]


def _prefix(names: dict[str, str], index: int, wanted: set[str]) -> str | None:
    """The name prefix under which the checkpoint holds every tensor of layer `index` (model.layers.29.,
    language_model.model.layers.29., ...), None when no prefix holds them all."""
    marker = f"layers.{index}."
    prefixes = {name[: name.index(marker) + len(marker)] for name in names if marker in name}
    for prefix in sorted(prefixes, key=len):
        if all(prefix + key in names for key in wanted):
            return prefix
    return None
