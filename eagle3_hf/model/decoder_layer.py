"""The drafter's one decoder layer (the checkpoint's `midlayer`): its attention reads cat(embedding, hidden), twice
the width of a verifier layer's, which is what makes it an EAGLE-3 layer and not a Llama one. Kept apart from the
PreTrainedModel (modeling_eagle3.py), which runs it once per TTT step or once per draft step.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from .configuration_eagle3 import Eagle3Config
from .head_rows import gather_rows
from .ttt_attention import DraftKeys, Eagle3Attention, TTTKeys


class Eagle3DecoderLayer(nn.Module):
    """The drafter's one layer. Input cat(input_layernorm(embed), hidden_norm(h)); residual = h, or hidden_norm(h)
    with `norm_before_residual` (vLLM's `_norm_before_residual`)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.norm_before_residual = config.norm_before_residual
        self.self_attn = Eagle3Attention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], keys: TTTKeys | DraftKeys,
                mlp_rows: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [B, L, H] (the next tokens' embeddings), hidden [B, L, H] (projected verifier features or the
        previous step's output) -> the pre-norm output [B, L, H] that the next step feeds back.

        With `mlp_rows` (flat positions [R] into [B * L], `HeadRows.mlp`) the MLP runs there only: elsewhere the
        output is never read (see the model's forward)."""
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed_hidden], dim=-1)  # [B, L, 2H], embedding first
        hidden = residual + self.self_attn(x, position_embeddings, keys)  # [B, L, H]
        if mlp_rows is None:
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        kept = gather_rows(hidden, mlp_rows)  # [R, H]
        out = hidden.reshape(-1, hidden.shape[-1]).index_add(0, mlp_rows, self.mlp(self.post_attention_layernorm(kept)))
        return out.view_as(hidden)

