"""DFlashDraftModel: the block-diffusion drafter (DFlash, arXiv 2602.06036) as a transformers PreTrainedModel.

What the engines compute (vLLM 0.32 `model_executor/models/qwen3_dflash.py` and `v1/spec_decode/dflash.py`):
the verifier's aux states of every accepted token are fused, `ctx = hidden_norm(fc(cat(aux)))`, and each layer
projects its context keys and values from that one state (`k_norm(k_proj(ctx))` with RoPE at the token's position,
`v_proj(ctx)`: `precompute_and_store_context_kv`). One forward then runs the block `[anchor, mask x (B - 1)]` at
positions p .. p + B - 1 (p: the position after the last context token; the anchor is the verifier's newest token,
whose own features do not exist yet) through N Qwen3 layers whose attention sees the context's keys and, with no
causal mask, the block's own. Block position k >= 1 predicts the token at p + k; logits are the verifier's
`lm_head(norm(out))`. Names match the checkpoint vLLM loads (`layers.{i}.*`, `fc`, `hidden_norm`, `norm`); the
embedding and lm_head are the verifier's, never saved.

Two entry points: `forward`, blocks at many anchors of a *packed* batch in one attention call per layer (each
block sees its document's context before its anchor and itself), and `draft_block`, one block after a cache of
context keys (`DFlashContext`), as decoding runs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half
from transformers.utils import ModelOutput

from ..verifier.family import softcap_logits
from .configuration_dflash import DFlashConfig

NOT_SAVED = ("embed_tokens.weight", "lm_head.weight")  # the verifier's: engines share them


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd], cos/sin [B, T, hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(nn.Module):
    """Qwen3 attention (q/k RMSNorm per head) over the context's keys followed by the block's own."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.head_dim = int(config.head_dim)
        self.heads, self.kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads or 1)
        hidden, bias = config.hidden_size, bool(config.attention_bias)
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).transpose(1, 2)  # [B, n, T, hd]

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, kv_heads, T, hd] (k normed, then rotated)."""
        k = _rope(self.k_norm(self._heads(self.k_proj(x), self.kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, H] (the block, normed); context k, v [B, kv, C, hd]; mask bool [B, 1, Q, C + Q] (True: may
        attend) or None (every key)."""
        q = _rope(self.q_norm(self._heads(self.q_proj(x), self.heads)), cos, sin)
        k, v = self.key_value(x, cos, sin)
        k, v = torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2)
        groups = self.heads // self.kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, heads, Q, hd]
        return cast(torch.Tensor, self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1)))


class DFlashDecoderLayer(nn.Module):
    """A Qwen3 pre-norm layer; its attention also reads the context keys of this layer."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, context, mask)
        return cast(torch.Tensor, hidden + self.mlp(self.post_attention_layernorm(hidden)))


@dataclass
class DFlashContext:
    """The drafter's cache at decoding time: per layer, the context's keys and values [1, kv, C, hd] for every
    accepted token, in position order. Context keys depend only on the verifier's features, so an accepted token's
    entry never changes and nothing is ever cropped."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else int(self.keys[0].shape[2])


@dataclass
class DFlashOutput(ModelOutput):
    """Blocks at the batch's anchors. logits [N, B - 1, V] for block positions 1 .. B - 1 of the N valid anchors
    (row-major over `anchors`); teacher_probs [N, B - 1, V] fp32, the verifier's distribution of the same tokens
    (its softmax at the position before each), when a teacher is attached."""

    logits: torch.Tensor | None = None
    teacher_probs: torch.Tensor | None = None


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    config: DFlashConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _keys_to_ignore_on_load_missing = list(NOT_SAVED)


class DFlashDraftModel(DFlashPreTrainedModel):
    """DFlash drafter. `embed_tokens` and `lm_head` hold the verifier's rows (frozen, never saved): load them with
    `load_verifier_weights(embed, head)` before any forward."""

    drafter_kind = "dflash"
    source_layout = "dflash"
    anchors_per_row = 64  # blocks per packed row in training (train --dflash-anchors); not part of the checkpoint

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        if config.mask_token_id is None:
            raise ValueError("a DFlash drafter needs mask_token_id (a verifier token the training data never contains)")
        hidden = config.hidden_size
        target = config.target_hidden_size or hidden
        num_aux = len(config.aux_hidden_state_indices or [0, 0, 0])
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.fc = nn.Linear(num_aux * target, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self._loaded: set[str] = set()  # which of the verifier's weights are in place
        self.teacher_logit_softcap: float | None = None
        self.post_init()
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    # ------------------------------------------------------------------ the verifier's weights

    def load_verifier_weights(self, embed: torch.Tensor, head: torch.Tensor,
                              logit_softcap: float | None = None) -> None:
        """The verifier's raw input embedding [V, H] and lm_head [V, H] (the engines share both); the soft-cap applies
        to the teacher only (vLLM's DFlash logits processor applies none, and an argmax does not see it)."""
        self._copy_frozen("embedding", self.embed_tokens, embed)
        self._copy_frozen("lm_head", self.lm_head, head)
        self.teacher_logit_softcap = logit_softcap
        self._loaded = {"embedding", "lm_head"}

    def load_verifier_embeddings(self, verifier: PreTrainedModel | torch.Tensor) -> None:
        """A verifier model: its embedding, lm_head and soft-cap (what `evaluate` calls on any drafter); a tensor
        [V, H]: the embedding alone (the training script's call, `attach_teacher` then gives the head)."""
        if isinstance(verifier, torch.Tensor):
            self._copy_frozen("embedding", self.embed_tokens, verifier)
            self._loaded.add("embedding")
            return
        from ..verifier.family import logit_softcap

        embed = cast(torch.Tensor, verifier.get_input_embeddings().weight)
        head = cast(torch.Tensor, verifier.get_output_embeddings().weight)
        self.load_verifier_weights(embed, head, logit_softcap(verifier))

    def attach_teacher(self, head: torch.Tensor, logit_softcap: float | None = None,
                       in_vocab_mass: bool = False) -> None:
        """The verifier's lm_head [V, H]: the drafter's own head and the teacher's alike (full vocabulary, so the
        teacher's mass on the drafter's vocabulary is 1 and `in_vocab_mass` needs nothing more)."""
        self._copy_frozen("lm_head", self.lm_head, head)
        self.teacher_logit_softcap = logit_softcap
        self._loaded.add("lm_head")

    @property
    def verifier_weights_loaded(self) -> bool:
        return self._loaded == {"embedding", "lm_head"}

    @staticmethod
    def _copy_frozen(name: str, module: nn.Embedding | nn.Linear, weight: torch.Tensor) -> None:
        rows, width = module.weight.shape
        if weight.dim() != 2 or weight.shape[0] < rows or weight.shape[1] != width:
            raise ValueError(f"verifier {name} {tuple(weight.shape)} does not fit the drafter's {(rows, width)} "
                             "(vocab_size x hidden_size)")
        with torch.no_grad():
            module.weight.copy_(weight[:rows].to(module.weight.dtype))
        module.weight.requires_grad_(False)

    def _check_verifier_weights(self) -> None:
        if not self.verifier_weights_loaded:
            raise RuntimeError("this DFlash drafter has no verifier embedding / lm_head (engines share the "
                               "verifier's): call model.load_verifier_weights(embed, head) or pass verifier=... to "
                               "from_pretrained")

    @torch.no_grad()
    def teacher_distribution(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """softmax(verifier lm_head(h_last)) over the full vocabulary, fp32, with the verifier's soft-cap."""
        logits = self.lm_head(last_hidden_state.to(self.lm_head.weight.dtype)).float()
        return torch.softmax(softcap_logits(logits, self.teacher_logit_softcap), dim=-1)

    # ------------------------------------------------------------------ the shared pieces

    def fuse_features(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """Verifier aux states [.., A x T] -> the normed context state [.., H] every layer's context keys read."""
        expected = self.fc.in_features
        if aux_hidden_states.shape[-1] != expected:
            raise ValueError(f"features have size {aux_hidden_states.shape[-1]}; this drafter's fc expects {expected} "
                             "(its aux layers x the verifier's hidden size)")
        return cast(torch.Tensor, self.hidden_norm(self.fc(aux_hidden_states.to(self.fc.weight.dtype))))

    def _cos_sin(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary_emb(like, positions)
        return cos, sin

    def context_key_values(self, context: torch.Tensor,
                           positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Fused context [B, C, H] at positions [B, C] -> per layer (k, v) [B, kv, C, hd]."""
        cos, sin = self._cos_sin(context, positions)
        return [cast(DFlashDecoderLayer, layer).self_attn.key_value(context, cos, sin) for layer in self.layers]

    def run_block(self, block_ids: torch.Tensor, block_positions: torch.Tensor,
                  context: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None) -> torch.Tensor:
        """block_ids, block_positions [B, Q] -> norm(out) [B, Q, H]: the layers over the blocks, whose keys come after
        the context's in `mask`'s key order."""
        hidden = self.embed_tokens(block_ids)
        cos, sin = self._cos_sin(hidden, block_positions)
        for layer, kv in zip(self.layers, context):
            hidden = layer(hidden, cos, sin, kv, mask)
        return cast(torch.Tensor, self.norm(hidden))

    # ------------------------------------------------------------------ training: blocks at many anchors

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        anchors: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        last_hidden_state: torch.Tensor | None = None,
    ) -> DFlashOutput:
        """Blocks at `anchors` [B, A] (positions into each row, -1 = none) of a packed batch: input_ids [B, L],
        aux_hidden_states [B, L, A x T], position_ids [B, L] (restarting at 0 per document), document_ids [B, L].

        Block j of row b is `[input_ids[b, a], mask x (B - 1)]` at positions position_ids[b, a] + 0 .. B - 1; it
        attends to the context keys of its document's tokens before a (their features, as the engine injects them)
        and to its own keys, without a causal mask, never to another block. One attention call per layer over every
        block of the batch. With `last_hidden_state` [B, L, H], the teacher of block position k is the verifier's
        distribution at a + k - 1 (clamped at the row's end; the loss masks what leaves the document)."""
        self._check_verifier_weights()
        batch, length = input_ids.shape
        device = input_ids.device
        size = int(self.config.block_size)
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(length, device=device).expand(batch, length)
        valid = anchors >= 0  # [B, A]
        at = anchors.clamp(min=0)
        num_anchors = anchors.shape[1]
        offsets = torch.arange(size, device=device)

        context = self.fuse_features(aux_hidden_states)  # [B, L, H]
        context_kv = self.context_key_values(context, position_ids)
        block_ids = torch.full((batch, num_anchors, size), int(cast(int, self.config.mask_token_id)), device=device,
                               dtype=input_ids.dtype)
        block_ids[:, :, 0] = input_ids.gather(1, at)
        block_positions = position_ids.gather(1, at)[:, :, None] + offsets  # [B, A, S]

        # who sees what: context key i from block j iff same document and i < anchor j; block keys within the block
        anchor_doc = document_ids.gather(1, at)  # [B, A]
        keys = torch.arange(length, device=device)
        sees_context = ((document_ids[:, None, :] == anchor_doc[:, :, None]) & (keys[None, None, :] < at[:, :, None])
                        & valid[:, :, None])  # [B, A, L]
        block_of = torch.arange(num_anchors, device=device).repeat_interleave(size)  # [A * S]
        sees_block = block_of[:, None] == block_of[None, :]  # [A * S, A * S]
        mask = torch.cat([sees_context.repeat_interleave(size, dim=1),
                          sees_block.expand(batch, -1, -1)], dim=2)[:, None]  # [B, 1, A * S, L + A * S]

        out = self.run_block(block_ids.view(batch, -1), block_positions.view(batch, -1), context_kv, mask)
        out = out.view(batch, num_anchors, size, -1)[valid][:, 1:]  # [N, S - 1, H]
        logits = self.lm_head(out)
        teacher = None
        if last_hidden_state is not None:
            read = (at[:, :, None] + offsets[None, None, : size - 1]).clamp(max=length - 1)  # a + k - 1, k = 1 .. S-1
            rows = last_hidden_state.gather(1, read.view(batch, -1, 1).expand(-1, -1, last_hidden_state.shape[-1]))
            teacher = self.teacher_distribution(rows.view(batch, num_anchors, size - 1, -1)[valid])
        return DFlashOutput(logits=logits, teacher_probs=teacher)

    # ------------------------------------------------------------------ decoding: one block after a cache

    @torch.no_grad()
    def extend_context(self, context: DFlashContext | None, aux_hidden_states: torch.Tensor,
                       positions: torch.Tensor) -> DFlashContext:
        """Add the verifier's features [1, c, A x T] of accepted tokens at positions [1, c] (the next ones after the
        cache) to the context, as the engine's `precompute_and_store_context_kv` does."""
        context = context if context is not None else DFlashContext()
        if context.length and int(positions[0, 0]) != context.length:
            raise ValueError(f"context holds {context.length} positions; new features start at {int(positions[0, 0])}")
        kv = self.context_key_values(self.fuse_features(aux_hidden_states), positions)
        if not context.keys:
            context.keys, context.values = [k for k, _ in kv], [v for _, v in kv]
        else:
            context.keys = [torch.cat([old, k], dim=2) for old, (k, _) in zip(context.keys, kv)]
            context.values = [torch.cat([old, v], dim=2) for old, (_, v) in zip(context.values, kv)]
        return context

    @torch.no_grad()
    def draft_block(self, anchor_id: int, context: DFlashContext, num_drafts: int | None = None) -> torch.Tensor:
        """Logits [num_drafts, V] of the tokens after `anchor_id`, the token at position `context.length` (the one
        after the last context token). The block is the anchor and `num_drafts` masks (default block_size - 1, at
        most that), as vLLM queries 1 + num_speculative_tokens positions."""
        self._check_verifier_weights()
        drafts = self.config.max_drafts if num_drafts is None else int(num_drafts)
        if not 1 <= drafts <= self.config.max_drafts:
            raise ValueError(f"num_drafts {drafts} must lie in 1..{self.config.max_drafts} (block_size - 1)")
        device = self.fc.weight.device
        ids = torch.full((1, drafts + 1), int(cast(int, self.config.mask_token_id)), device=device)
        ids[0, 0] = int(anchor_id)
        positions = context.length + torch.arange(drafts + 1, device=device)[None]
        out = self.run_block(ids, positions, list(zip(context.keys, context.values)), None)
        return cast(torch.Tensor, self.lm_head(out[0, 1:]))

    # ------------------------------------------------------------------ checkpoints

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
        """Write the layout vLLM loads: config.json and model.safetensors without the verifier's embedding and
        lm_head, every name and shape checked (`dflash_checkpoint.served_state_dict`)."""
        from .dflash_checkpoint import served_state_dict

        state_dict = kwargs.pop("state_dict", None)
        kwargs["state_dict"] = served_state_dict(self.state_dict() if state_dict is None else state_dict, self.config)
        kwargs.setdefault("max_shard_size", "100GB")  # one model.safetensors
        return super().save_pretrained(save_directory, *args, **kwargs)

    def should_save_on_this_rank(self, is_main_process: bool) -> bool:
        return is_main_process

    @classmethod
    def from_pretrained(  # type: ignore[override]  # a directory, the verifier's weights by keyword
        cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, verifier: PreTrainedModel | None = None,
        revision: str | None = None, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> DFlashDraftModel:
        """Load the served layout (`dflash_checkpoint.read_dflash_checkpoint`: names and shapes asserted);
        `verifier` (a model) fills the embedding and lm_head."""
        from .dflash_checkpoint import read_dflash_checkpoint

        if args:
            raise TypeError(f"unexpected positional arguments {args}")
        kwargs.pop("trust_remote_code", None)
        attn = kwargs.pop("attn_implementation", None)
        if kwargs:
            raise TypeError(f"unsupported from_pretrained arguments: {sorted(kwargs)}")
        config, tensors = read_dflash_checkpoint(pretrained_model_name_or_path, revision)
        config._attn_implementation = attn or "sdpa"
        model = cls(config)
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys or [k for k in result.missing_keys if k not in NOT_SAVED]:
            raise ValueError(f"{pretrained_model_name_or_path}: state dict mismatch {result}")
        if verifier is not None:
            model.load_verifier_embeddings(verifier)
        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        if isinstance(dtype, torch.dtype):
            model.to(dtype)  # type: ignore[arg-type]
        if device is not None:
            model.to(device)  # type: ignore[arg-type]
        model.eval()
        return model

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
