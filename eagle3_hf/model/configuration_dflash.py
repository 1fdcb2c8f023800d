"""DFlashConfig: a Qwen3 config for a block-diffusion drafter (DFlash, arXiv 2602.06036), as the engines read it.

The saved `config.json` is a Qwen3 config (`model_type "qwen3"`, `architectures ["DFlashDraftModel"]`, N full-attention
layers at the verifier's hidden size) plus the DFlash keys: `block_size`, and `dflash_config {mask_token_id,
target_layer_ids}` where an id names the *output* of a verifier layer (our `output_hidden_states` index minus one;
vLLM 0.32 adds one back in `get_eagle3_aux_layers_from_config`). No `eagle_config` is written: vLLM's V1 runner
(`gpu_model_runner._get_eagle3_aux_layers_from_config`) lets an `eagle_config` override `dflash_config`'s ids.
`rope_theta` is written at the top level as well as in `rope_parameters`: vLLM's DFlash layer defaults a missing
theta to 1e6 (`set_default_rope_theta`), not to the verifier's.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config

from ..verifier.family import text_config_dict, verifier_record

DFLASH_ARCHITECTURE = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16  # z-lab's Qwen3 drafters ("-b16"); SpecForge's Qwen3-8B DFlash config: 5 layers, blocks of 16
DEFAULT_LAYERS = 5
# weight exp(-(k - 1) / decay) of block position k, the form of SpecForge's `loss_decay_gamma` (which is off by
# default there); 7 is our choice, not a measured optimum
DEFAULT_LOSS_DECAY = 7.0


@strict
class DFlashConfig(Qwen3Config):
    r"""
    Configuration of a DFlash drafter: `num_hidden_layers` Qwen3 decoder layers (q/k RMSNorm) whose attention reads,
    besides the block's own keys, keys and values projected from the verifier's fused features of the context
    (`fc` over the concatenated aux states, then `hidden_norm`); logits are the verifier's `lm_head(norm(out))`.

    Fields beyond Qwen3Config:
        block_size (`int`, 16): one forward drafts `[anchor, mask x (block_size - 1)]`; position k predicts the token
            k places after the anchor, so at most block_size - 1 tokens are drafted per verify forward.
        mask_token_id (`int`): the token fed at the mask positions; a verifier token the training data never
            contains (the engines embed it with the verifier's embedding).
        target_hidden_size (`int`, defaults to hidden_size): the verifier's hidden size; `fc` maps
            len(aux) x target_hidden_size to hidden_size.
        aux_hidden_state_indices (`list[int]`): verifier `output_hidden_states` indices the drafter reads, written
            as `dflash_config.target_layer_ids` (each minus one).
        block_loss_decay (`float`, 7.0): training weight exp(-(k - 1) / decay) of block position k (recorded).
        verifier_* / tokenizer_fingerprint: provenance, as Eagle3Config's.
    """

    model_type = "qwen3"

    block_size: int = DEFAULT_BLOCK_SIZE
    mask_token_id: int | None = None
    target_hidden_size: int | None = None
    aux_hidden_state_indices: list[int] | None = None
    block_loss_decay: float = DEFAULT_LOSS_DECAY
    verifier_name_or_path: str | None = None
    verifier_revision: str | None = None
    verifier_num_hidden_layers: int | None = None
    verifier_architectures: list[str] | None = None
    tokenizer_fingerprint: str | None = None
    verifier_tokenizer_class: str | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        self.tie_word_embeddings = False
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        dflash = kwargs.pop("dflash_config", None) or {}
        if self.aux_hidden_state_indices is None and dflash.get("target_layer_ids") is not None:
            self.aux_hidden_state_indices = [int(i) + 1 for i in dflash["target_layer_ids"]]
        if self.mask_token_id is None and dflash.get("mask_token_id") is not None:
            self.mask_token_id = int(dflash["mask_token_id"])
        if dflash.get("block_size") is not None:  # read there first, as llama.cpp's converter does
            self.block_size = int(dflash["block_size"])
        if self.rope_parameters:
            kwargs.pop("rope_theta", None)  # written derived from rope_parameters
            kwargs.pop("rope_scaling", None)
        kwargs.pop("architectures", None)
        super().__post_init__(**kwargs)
        self.architectures = [DFLASH_ARCHITECTURE]
        if self.block_size < 2:
            raise ValueError(f"block_size {self.block_size} must be at least 2 (the anchor and one masked position)")
        if self.layer_types is not None and any(t != "full_attention" for t in self.layer_types):
            raise ValueError(f"layer_types {self.layer_types}: a DFlash drafter here is all full attention (a sliding "
                             "layer would be served causal by vLLM)")

    @property
    def drafter_kind(self) -> str:
        return "dflash"

    @property
    def max_drafts(self) -> int:
        """Tokens one block drafts: every position after the anchor."""
        return int(self.block_size) - 1

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["architectures"] = [DFLASH_ARCHITECTURE]
        d["model_type"] = "qwen3"
        d["tie_word_embeddings"] = False
        rope = dict(d.get("rope_parameters") or {})
        d["rope_theta"] = rope.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            d["rope_scaling"] = None
        else:
            scaling["type"] = scaling["rope_type"]
            d["rope_scaling"] = scaling
        d["dflash_config"] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": [int(i) - 1 for i in (self.aux_hidden_state_indices or [])],
            "block_size": int(self.block_size),  # llama.cpp's converter reads it here first, SGLang either place
        }
        d["layer_types"] = ["full_attention"] * int(self.num_hidden_layers)
        # no window keys at all: llama.cpp's converter turns a sliding window on from them
        for key in ("sliding_window", "use_sliding_window", "max_window_layers"):
            d.pop(key, None)
        return d

    def to_diff_dict(self) -> dict[str, Any]:
        # save_pretrained writes the diff against defaults; the keys the engines read must always be there
        d = super().to_diff_dict()
        full = self.to_dict()
        for key in ("architectures", "model_type", "num_hidden_layers", "tie_word_embeddings", "rope_theta",
                    "rope_scaling", "rope_parameters", "dflash_config", "block_size", "target_hidden_size",
                    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "rms_norm_eps", "max_position_embeddings", "layer_types", "attention_bias",
                    "hidden_act"):
            if key in full:
                d[key] = full[key]
        for key in ("aux_hidden_state_indices", "mask_token_id",  # dflash_config carries them, in the engines' form
                    "sliding_window", "use_sliding_window", "max_window_layers"):
            d.pop(key, None)
        return d

    @classmethod
    def from_verifier(
        cls,
        verifier_config: Any,
        mask_token_id: int,
        aux_hidden_state_indices: list[int] | None = None,
        num_hidden_layers: int = DEFAULT_LAYERS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        verifier_name_or_path: str | None = None,
        verifier_revision: str | None = None,
        tokenizer_fingerprint: str | None = None,
        **overrides: Any,
    ) -> DFlashConfig:
        """A DFlash drafter for any HF causal-LM config: hidden size, heads, KV heads, head_dim, FFN width and RoPE
        of the verifier (its layers are what the drafter's layers imitate; the verifier's embedding and lm_head are
        shared, so the hidden size must be the verifier's), `num_hidden_layers` full-attention layers."""
        cfg = text_config_dict(verifier_config)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
        if not 0 <= int(mask_token_id) < vocab:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the verifier's vocabulary of {vocab}")
        kwargs: dict[str, Any] = dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            num_hidden_layers=int(num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            hidden_act="silu",
            attention_bias=False,
            use_sliding_window=False,
            sliding_window=None,
            layer_types=["full_attention"] * int(num_hidden_layers),
            block_size=int(block_size),
            mask_token_id=int(mask_token_id),
            **verifier_record(verifier_config, aux_hidden_state_indices, verifier_name_or_path, verifier_revision,
                              tokenizer_fingerprint),
        )
        kwargs.update(overrides)
        return cls(**kwargs)
