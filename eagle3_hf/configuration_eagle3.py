"""Eagle3Config: a Llama config for a one-layer EAGLE-3 drafter, written the way SGLang and vLLM read it.

The saved `config.json` is a plain Llama config (`model_type "llama"`,
`architectures ["LlamaForCausalLMEagle3"]`, one hidden layer) plus the EAGLE-3 keys the engines look for.
The aux-layer convention lives in exactly one place, `engine_aux_layer_ids`, because engines disagree:

- eagle3_hf trains on transformers `output_hidden_states` indices (0 = embeddings, k = output of decoder
  layer k-1); the drafter reads three of them, `aux_hidden_state_indices`.
- vLLM (`vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`) reads only the top-level
  `eagle_aux_hidden_state_layer_ids` and captures the residual stream *entering* layer id, which is the same
  number as the `output_hidden_states` index.
- SGLang (`model_runner.py` reads `eagle_config.eagle_aux_hidden_state_layer_ids`; the target model's
  `set_eagle3_layers_to_capture`, e.g. `python/sglang/srt/models/llama.py`, adds 1: its id names a layer
  *output*). Without ids both engines default to indices (2, N//2, N-3).
- `norm_before_residual`: SGLang's `llama_eagle3.py` hard-codes the un-normed residual (false); vLLM honours
  the key and defaults it to true for the speculators layout, so it is always written explicitly.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

# rope types Llama attention in transformers (and the engines' Llama drafter) can apply
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
DRAFTER_ARCHITECTURE = "LlamaForCausalLMEagle3"
PREFERRED_HEAD_DIM = 128


def engine_aux_layer_ids(indices: list[int] | tuple[int, ...]) -> dict[str, list[int]]:
    """The aux-layer ids each engine must read for a drafter trained on `output_hidden_states` indices."""
    indices = [int(i) for i in indices]
    if any(i < 1 for i in indices):
        raise ValueError(f"aux hidden-state indices must be >= 1 (0 is the embedding output): {indices}")
    return {"vllm": list(indices), "sglang": [i - 1 for i in indices]}


def aux_indices_from_config(config: dict[str, Any]) -> list[int] | None:
    """Recover training indices from a published config: top-level (vLLM) ids win, else SGLang's + 1."""
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top:
        return [int(i) for i in top]
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:
        return [int(i) + 1 for i in nested]
    return None


def default_aux_indices(num_layers: int) -> list[int]:
    """(2, N//2, N-3): low, middle and high layers, the EAGLE-3 paper's and both engines' default.

    Below 7 layers (tiny test models) that triple collides, so (1, N//2, N-1) is used instead.
    """
    if num_layers < 4:
        raise ValueError(f"a verifier needs at least 4 layers for three distinct aux indices, got {num_layers}")
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    return [1, num_layers // 2, num_layers - 1]


def check_aux_indices(aux_indices, num_layers: int) -> list[int]:
    """Three distinct indices in 1..N-1 (0 is the embedding; N is post-norm and no engine can capture it)."""
    indices = [int(i) for i in aux_indices]
    if len(indices) != 3:
        raise ValueError(f"expected 3 aux layer indices, got {indices}")
    if len(set(indices)) != 3:
        raise ValueError(f"aux layer indices must be distinct, got {indices}")
    bad = [i for i in indices if not 1 <= i <= num_layers - 1]
    if bad:
        raise ValueError(
            f"aux indices {bad} are outside 1..{num_layers - 1} for a {num_layers}-layer verifier: they are "
            f"output_hidden_states indices (0 is the embedding; {num_layers} is post-norm and no engine can capture it)"
        )
    return indices


def text_config(verifier: Any) -> Any:
    """The language-model part of a verifier's config: the one lookup every stage uses.

    Kimi-K2.5, Gemma 3 and other VLMs nest it under `text_config`; sizes, layer count, vocabulary and the
    logit soft-cap must all be read there. `verifier` is a model, a `PretrainedConfig` (-> transformers'
    `get_text_config()`) or a `config.json` dict (-> a dict).
    """
    config = getattr(verifier, "config", verifier)
    if isinstance(config, dict):
        inner = config.get("text_config")
        return dict(inner) if isinstance(inner, dict) and "hidden_size" in inner else dict(config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def text_config_dict(verifier: Any) -> dict[str, Any]:
    """`text_config(verifier)` as a plain dict."""
    config = text_config(verifier)
    return config if isinstance(config, dict) else config.to_dict()


def logit_softcap(verifier: Any) -> float | None:
    """The verifier's final logit soft-cap (Gemma 2/3), from its text config; None when it has none."""
    config = text_config(verifier)
    value = config.get("final_logit_softcapping") if isinstance(config, dict) else getattr(
        config, "final_logit_softcapping", None)
    return float(value) if value else None


# per-layer-type RoPE (Gemma 2/3, ...): the layer type whose RoPE the drafter takes, in order of preference
DRAFTER_ROPE_LAYER_TYPES = ("full_attention", "global_attention")


def drafter_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """The one flat Llama `rope_parameters` a drafter gets from a verifier text config.

    Per family: Llama / Qwen3 / DeepSeek-V3 / Kimi have one RoPE, kept with its scaling (YaRN, llama3, ...)
    because the drafter sees the same positions as the verifier. Gemma 3 (and other verifiers with
    per-layer-type `rope_parameters`, nested `{"full_attention": {...}, "sliding_attention": {...}}`)
    gives the full-attention layers' RoPE: the drafter attends over the whole context, as those layers do,
    and it is the long-context one (the sliding layers' short-range base would alias at long distances).
    A nested dict cannot be passed on: transformers' Llama config drops the per-type keys with a warning
    and both engines' Llama drafter read a single RoPE (`rope_scaling`/`rope_theta` in SGLang's
    `LlamaDecoderLayer`), so what they would apply is not what training used. Types Llama attention cannot
    apply (multimodal mrope) become plain RoPE at the same base: the drafter sees text positions only.
    """
    params = dict(cfg.get("rope_parameters") or {})
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    if nested:
        layer_type = next((t for t in DRAFTER_ROPE_LAYER_TYPES if t in nested), sorted(nested)[0])
        params = dict(nested[layer_type])
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        params = {"rope_type": "default", "rope_theta": params["rope_theta"]}
    return params


def engine_config_problems(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """(code, message) for each field of a drafter config.json an engine's Llama-EAGLE-3 loader cannot parse.

    What the engines read (their source): SGLang's `LlamaDecoderLayer` (`python/sglang/srt/models/llama.py`)
    takes the legacy `rope_theta` / `rope_scaling` and its `LlamaMLP` raises unless `hidden_act` is "silu";
    vLLM builds the drafter from the same Llama config through transformers, whose RoPE validation keeps
    only the flat keys of its `rope_type`. `check` reports these as errors.
    """
    problems: list[tuple[str, str]] = []
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key) or {}
        if not isinstance(value, dict):
            problems.append(("rope-unparsable", f"{key} is {type(value).__name__}, not a dict"))
            continue
        nested = sorted(k for k, v in value.items() if isinstance(v, dict))
        if nested:
            problems.append(("rope-per-layer-type", f"{key} mixes per-layer-type RoPE {nested} into a Llama "
                             "config: the engines' one-layer Llama drafter has a single RoPE, transformers drops "
                             "the nested keys with a warning, so serving would not apply the RoPE training used "
                             "(re-export: from_verifier writes the full-attention RoPE flat)"))
        rope_type = value.get("rope_type", value.get("type", "default"))
        if value and rope_type not in SUPPORTED_ROPE_TYPES:
            problems.append(("rope-type", f"{key} rope_type {rope_type!r} is not one the Llama drafter can "
                             f"apply ({', '.join(SUPPORTED_ROPE_TYPES)})"))
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(("hidden-act", f"hidden_act {cfg.get('hidden_act')!r}: SGLang's LlamaMLP supports only "
                         "'silu' and refuses to load the drafter"))
    return problems


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
        norm_before_residual (`bool`, False): residual is the un-normed hidden (SGLang hard-codes this).
        verifier_name_or_path / verifier_revision / verifier_num_hidden_layers / tokenizer_fingerprint:
            provenance, checked when a drafter is finetuned or evaluated against a verifier.
        ttt_steps (`int`, 3) / ttt_step_weight (`float`, 0.8): training-time-test defaults.
    """

    model_type = "llama"

    draft_vocab_size: int = 32000
    target_hidden_size: int | None = None
    aux_hidden_state_indices: list[int] | None = None
    norm_before_residual: bool = False
    verifier_name_or_path: str | None = None
    verifier_revision: str | None = None
    verifier_num_hidden_layers: int | None = None
    tokenizer_fingerprint: str | None = None
    ttt_steps: int = 3
    ttt_step_weight: float = 0.8

    def __post_init__(self, **kwargs):
        self.num_hidden_layers = 1
        self.tie_word_embeddings = False
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        # published configs carry the ids in engine form only; recover the training indices from them
        engine_keys = {k: kwargs.pop(k) for k in ("eagle_aux_hidden_state_layer_ids", "eagle_config") if k in kwargs}
        if self.aux_hidden_state_indices is None:
            self.aux_hidden_state_indices = aux_indices_from_config(engine_keys)
        kwargs.pop("use_aux_hidden_state", None)
        if self.rope_parameters:
            # legacy keys are written derived from rope_parameters; reading them back would duplicate it
            kwargs.pop("rope_scaling", None)
            kwargs.pop("rope_theta", None)
        kwargs.pop("architectures", None)
        super().__post_init__(**kwargs)
        self.architectures = [DRAFTER_ARCHITECTURE]

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
        return d

    def to_diff_dict(self) -> dict[str, Any]:
        # save_pretrained writes the diff against defaults; the engine keys must always be there
        d = super().to_diff_dict()
        full = self.to_dict()
        for key in ("architectures", "model_type", "num_hidden_layers", "tie_word_embeddings", "rope_theta",
                    "rope_scaling", "eagle_aux_hidden_state_layer_ids", "eagle_config", "draft_vocab_size",
                    "target_hidden_size", "vocab_size", "hidden_size", "norm_before_residual",
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
    ) -> "Eagle3Config":
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
        num_layers = int(cfg["num_hidden_layers"])
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
        aux = check_aux_indices(aux_hidden_state_indices or default_aux_indices(num_layers), num_layers)
        kwargs: dict[str, Any] = dict(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            hidden_act="silu",  # the engines' Llama drafter has no other MLP
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_parameters=drafter_rope(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=hidden,
            aux_hidden_state_indices=aux,
            verifier_name_or_path=verifier_name_or_path or cfg.get("_name_or_path") or None,
            verifier_revision=verifier_revision,
            verifier_num_hidden_layers=num_layers,
            tokenizer_fingerprint=tokenizer_fingerprint,
        )
        kwargs.update(overrides)
        return cls(**kwargs)
