"""Eagle3Config: a Llama config for a one-layer EAGLE-3 drafter, written the way SGLang and vLLM read it.

The saved `config.json` is a plain Llama config (`model_type "llama"`,
`architectures ["LlamaForCausalLMEagle3"]`, one hidden layer) plus the EAGLE-3 keys the engines look for:
the aux-layer ids where each engine reads them (`verifier.family.engine_aux_layer_ids`), the draft
vocabulary size, and `norm_before_residual` written explicitly (SGLang's `llama_eagle3.py` hard-codes the
un-normed residual; vLLM honours the key and defaults it to true for the speculators layout).
How a verifier's own config is read (its text config, aux layers, RoPE, logit soft-cap) lives in
verifier/family.py; this file holds the drafter's config alone.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from ..verifier.family import aux_indices_from_config, engine_aux_layer_ids, text_config_dict, verifier_record

DRAFTER_ARCHITECTURE = "LlamaForCausalLMEagle3"
PREFERRED_HEAD_DIM = 128


@strict
class Eagle3Config(LlamaConfig):
    r"""
    Configuration of an EAGLE-3 draft model: one Llama decoder layer whose attention reads
    `cat(embedding, hidden)` (2 x hidden_size inputs), plus `fc`, `norm`, `lm_head` over a draft vocabulary.

    Fields beyond LlamaConfig:
        draft_vocab_size (`int`): rows of `lm_head`; `d2t` maps them to verifier ids.
        target_hidden_size (`int`, defaults to hidden_size): the verifier's hidden size; `fc` maps
            3 x target_hidden_size to hidden_size.
        aux_hidden_state_indices (`list[int]`): verifier `output_hidden_states` indices the drafter reads.
            Written for vLLM as top-level `eagle_aux_hidden_state_layer_ids` and for SGLang (minus one) in
            `eagle_config`; see `engine_aux_layer_ids`.
        norm_before_residual (`bool`, False): the residual around the attention is `hidden_norm(h)` instead of the
            un-normed `h` (trained with `--norm-before-residual`; speculators' training default). Written at the top
            level of both layouts, where vLLM's `llama_eagle3.py` reads it (default false there; true for the
            speculators layout when missing, `configs/speculators/algos.py`); SGLang hard-codes the un-normed
            residual in every version read (docs/contracts.md), so such a drafter serves on vLLM only.
        norm_before_fc (`bool`, False): EAGLE 3.1, one RMSNorm over the concatenated 3 x target_hidden_size aux
            input before `fc` (weight `input_norm.weight`). vLLM reads it from `eagle_config` first, then the top
            level (`llama_eagle3.py`); speculators applies it in its eagle3 `core.py`. Excludes `fc_norm`.
        fc_norm (`bool`, False): EAGLE 3.1, one RMSNorm per aux state (target_hidden_size each) before they are
            concatenated for `fc` (weights `fc_norm.{i}.weight`). Excludes `norm_before_fc` (speculators refuses
            both; vLLM would apply both, one after the other).
        norm_output (`bool`, False): EAGLE 3.1, the drafter's post-norm output `norm(out)` (what `lm_head` reads)
            is the state the next TTT step and the next draft step read, instead of the pre-norm `out`. No weight.
        sliding_window (`int`, None): attention sees only the last N tokens (itself included), in training and
            decoding alike (`ttt_attention`). Written as speculators and vLLM's Llama attention read it:
            `sliding_window` N with `layer_types ["sliding_attention"]` and `use_sliding_window: true`; read back
            only when `layer_types` marks the layer sliding, as vLLM does. None: full attention.
        verifier_name_or_path / verifier_revision / verifier_num_hidden_layers / tokenizer_fingerprint:
            provenance, checked when a drafter is finetuned or evaluated against a verifier.
        verifier_architectures (`list[str]`, None): the verifier's `architectures`, which pick SGLang's model file
            and so how it reads the aux-layer ids (`eagle3-hf check` without `--verifier` reads them here).
        verifier_tokenizer_class (`str`, None): the tokenizer class that tokenized the training data (a checkpoint's
            own class under --trust-remote-code, or transformers'); `evaluate` refuses to tokenize with another.
        verifier_chat_template_kwargs (`dict`, None): the chat-template kwargs the training text was rendered with
            (`prepare --chat-template-kwargs`, the thinking mode: `{"thinking": true}`); the server must render the
            same (`--default-chat-template-kwargs`), printed in the serve lines and checked by `check`. None: not
            recorded (data prepared before it was).
        ttt_steps (`int`, 3) / ttt_step_weight (`float`, 0.8): training-time-test defaults.
    """

    model_type = "llama"

    draft_vocab_size: int = 32000
    target_hidden_size: int | None = None
    aux_hidden_state_indices: list[int] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    sliding_window: int | None = None
    verifier_name_or_path: str | None = None
    verifier_revision: str | None = None
    verifier_num_hidden_layers: int | None = None
    verifier_architectures: list[str] | None = None
    tokenizer_fingerprint: str | None = None
    verifier_tokenizer_class: str | None = None
    verifier_chat_template_kwargs: dict[str, Any] | None = None
    ttt_steps: int = 3
    ttt_step_weight: float = 0.8

    def __post_init__(self, **kwargs: Any) -> None:
        self.num_hidden_layers = 1
        self.tie_word_embeddings = False
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        # published configs carry the ids in engine form only; recover the training indices from them
        engine_keys: dict[str, Any] = {
            k: kwargs.pop(k) for k in ("eagle_aux_hidden_state_layer_ids", "eagle_config") if k in kwargs}
        if self.aux_hidden_state_indices is None:
            self.aux_hidden_state_indices = aux_indices_from_config(engine_keys)
        kwargs.pop("use_aux_hidden_state", None)
        if self.rope_parameters:
            # legacy keys are written derived from rope_parameters; reading them back would duplicate it
            kwargs.pop("rope_scaling", None)
            kwargs.pop("rope_theta", None)
        kwargs.pop("architectures", None)
        # the window's other two keys are derived from sliding_window on write; a layer marked full attention
        # has no window whatever sliding_window says (vLLM's LlamaAttention reads layer_types first)
        layer_types = kwargs.pop("layer_types", None)
        kwargs.pop("use_sliding_window", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            self.sliding_window = None
        super().__post_init__(**kwargs)
        self.architectures = [DRAFTER_ARCHITECTURE]
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm are both true: pick one (speculators refuses both; vLLM would "
                             "norm the aux input twice)")
        if self.sliding_window is not None and self.sliding_window <= self.ttt_steps:
            raise ValueError(f"sliding_window {self.sliding_window} must exceed ttt_steps {self.ttt_steps}: a draft "
                             "step must see its own earlier drafts")

    @property
    def eagle_version(self) -> str:
        """"3.1" when any EAGLE 3.1 option is on, else "3.0": the recurrence and the fc input differ between them."""
        return "3.1" if (self.norm_before_fc or self.fc_norm or self.norm_output) else "3.0"

    def eagle31_options(self) -> dict[str, bool]:
        """The three EAGLE 3.1 options, by their config key."""
        return {"norm_before_fc": bool(self.norm_before_fc), "fc_norm": bool(self.fc_norm),
                "norm_output": bool(self.norm_output)}

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["architectures"] = [DRAFTER_ARCHITECTURE]
        d["model_type"] = "llama"
        d["num_hidden_layers"] = 1
        d["tie_word_embeddings"] = False
        # legacy rope keys: SGLang, speculators' converter and older loaders read these, not rope_parameters
        rope = dict(d.get("rope_parameters") or {})
        d["rope_theta"] = rope.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            d["rope_scaling"] = None
        else:
            scaling["type"] = scaling["rope_type"]
            d["rope_scaling"] = scaling
        if self.aux_hidden_state_indices:
            ids = engine_aux_layer_ids(self.aux_hidden_state_indices)
            d["eagle_aux_hidden_state_layer_ids"] = ids["vllm"]
            d["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": ids["sglang"],
                "use_aux_hidden_state": True,
                "use_input_layernorm_in_first_layer": True,
                "use_last_layernorm": True,
                "use_mtp_layernorm": False,
            }
        d.pop("sliding_window", None)
        if self.sliding_window is not None:
            d.update(sliding_window=int(self.sliding_window), layer_types=["sliding_attention"],
                     use_sliding_window=True)
        return d

    def to_diff_dict(self) -> dict[str, Any]:
        # save_pretrained writes the diff against defaults; the engine keys must always be there
        d = super().to_diff_dict()
        full = self.to_dict()
        for key in ("architectures", "model_type", "num_hidden_layers", "tie_word_embeddings", "rope_theta",
                    "rope_scaling", "eagle_aux_hidden_state_layer_ids", "eagle_config", "draft_vocab_size",
                    "target_hidden_size", "vocab_size", "hidden_size", "norm_before_residual",
                    "norm_before_fc", "fc_norm", "norm_output", "sliding_window", "layer_types", "use_sliding_window",
                    "rms_norm_eps", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "max_position_embeddings", "rope_parameters"):
            if key in full:
                d[key] = full[key]
        return d

    @classmethod
    def from_verifier(
        cls,
        verifier_config: Any,
        draft_vocab_size: int = 32000,
        aux_hidden_state_indices: list[int] | None = None,
        verifier_name_or_path: str | None = None,
        verifier_revision: str | None = None,
        tokenizer_fingerprint: str | None = None,
        **overrides: Any,
    ) -> Eagle3Config:
        """Derive a drafter config from any HF causal-LM config (Llama, Qwen, DeepSeek-V3, Kimi-K2/K2.5).

        Choices: hidden size = the verifier's (engines share its embedding); head_dim 128 where the
        hidden size divides by it (7168 -> 56 heads), else the verifier's head_dim, else 64; 8 KV heads
        where the head count allows, else the verifier's KV heads if they divide, else MHA; the verifier's
        dense FFN width and max_position_embeddings; the RoPE of `drafter_rope` (one flat RoPE, per family);
        SiLU whatever the verifier's activation. MLA, MoE and sliding-window fields are ignored: the drafter
        is always one full-attention GQA Llama layer, as the engines' Llama drafter is.
        """
        cfg = text_config_dict(verifier_config)
        hidden = int(cfg["hidden_size"])
        if hidden % PREFERRED_HEAD_DIM == 0:
            head_dim = PREFERRED_HEAD_DIM
        elif cfg.get("head_dim") and hidden % int(cfg["head_dim"]) == 0:
            head_dim = int(cfg["head_dim"])
        else:
            head_dim = 64
        if hidden % head_dim:
            raise ValueError(f"verifier hidden_size {hidden} is not divisible by any usable head_dim")
        heads = hidden // head_dim
        verifier_kv = cfg.get("num_key_value_heads")
        if heads % 8 == 0:
            kv_heads = 8
        elif verifier_kv and heads % int(verifier_kv) == 0:
            kv_heads = int(verifier_kv)
        else:
            kv_heads = heads
        kwargs: dict[str, Any] = dict(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            hidden_act="silu",  # the engines' Llama drafter has no other MLP
            draft_vocab_size=int(draft_vocab_size),
            **verifier_record(verifier_config, aux_hidden_state_indices, verifier_name_or_path, verifier_revision,
                              tokenizer_fingerprint),
        )
        kwargs.update(overrides)
        return cls(**kwargs)
