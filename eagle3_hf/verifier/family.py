"""How a verifier family's config is read: its text config, the aux layers and how each engine names them,
its logit soft-cap, and the one RoPE a drafter takes from it — the helpers every stage shares.

The aux-layer convention lives in exactly one place, `engine_aux_layer_ids`, because engines disagree:

- eagle3_hf trains on transformers `output_hidden_states` indices (0 = embeddings, k = output of decoder
  layer k-1); the drafter reads three of them, `aux_hidden_state_indices`.
- vLLM (`vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`) reads only the top-level
  `eagle_aux_hidden_state_layer_ids` and captures the residual stream *entering* layer id, which is the same
  number as the `output_hidden_states` index.
- SGLang (`model_runner.py` reads `eagle_config.eagle_aux_hidden_state_layer_ids`; the target model's
  `set_eagle3_layers_to_capture`, e.g. `python/sglang/srt/models/llama.py`, adds 1: its id names a layer
  *output*; the DeepSeek-V3 / Kimi files differ, `eagle3_hf/publish/aux_id_rules.py` has each family's reader).
  Without ids both engines default to indices (2, N//2, N-3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# rope types Llama attention in transformers (and the engines' Llama drafter) can apply
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


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

    Below 7 layers (tiny test models) that triple collides, so (2, N-2, N-1) is used instead, and (1, 2, 3) for 4
    layers: index 1 only where nothing else fits, because SGLang's versions read an export whose first id names
    it as different layers (publish/rules.py, its PR 25454).
    """
    if num_layers < 4:
        raise ValueError(f"a verifier needs at least 4 layers for three distinct aux indices, got {num_layers}")
    if num_layers >= 7:
        return [2, num_layers // 2, num_layers - 3]
    if num_layers == 4:
        return [1, 2, 3]
    return [2, num_layers - 2, num_layers - 1]


def aux_indices_problem(aux_indices: Iterable[int], num_layers: int | None) -> tuple[str, str] | None:
    """The one aux-layer rule: ("count", why) unless three distinct indices, ("range", why) for one outside
    1..N-1 (0 is the embedding; N is post-norm and no engine can capture it; with no verifier at hand, num_layers
    None, only 0 is refused), else None. `check_aux_indices` raises it; `check` and the drafter fit report it."""
    indices = [int(i) for i in aux_indices]
    if len(indices) != 3:
        return "count", f"expected 3 aux layer indices, got {indices}"
    if len(set(indices)) != 3:
        return "count", f"aux layer indices must be distinct, got {indices}"
    bad = [i for i in indices if i < 1 or (num_layers is not None and i > num_layers - 1)]
    if bad and num_layers is None:
        return "range", f"aux indices {bad} are below 1: they are output_hidden_states indices (0 is the embedding)"
    if bad and num_layers is not None:
        return "range", (f"aux indices {bad} are outside 1..{num_layers - 1} for a {num_layers}-layer verifier: they "
                         f"are output_hidden_states indices (0 is the embedding; {num_layers} is post-norm and no "
                         "engine can capture it)")
    return None


def check_aux_indices(aux_indices: Iterable[int], num_layers: int) -> list[int]:
    """Three distinct indices in 1..N-1, as ints; a ValueError saying why not (aux_indices_problem)."""
    problem = aux_indices_problem(aux_indices, num_layers)
    if problem:
        raise ValueError(problem[1])
    return [int(i) for i in aux_indices]


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


def softcap_logits(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """`softcap * tanh(logits / softcap)` (Gemma 2/3's final soft-cap), or the logits unchanged without one:
    the one place it is applied, so extraction, regeneration and the drafter's teacher agree."""
    return torch.tanh(logits / softcap) * softcap if softcap else logits


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


def verifier_record(verifier_config: Any, aux_indices: Iterable[int] | None = None,
                    name_or_path: str | None = None, revision: str | None = None,
                    tokenizer_fingerprint: str | None = None) -> dict[str, Any]:
    """What every drafter kind's config takes from the verifier it drafts for (its `from_verifier`): the aux layers
    it reads (checked, default `default_aux_indices`), the verifier's width, context, norm epsilon, RoPE
    (`drafter_rope`) and special tokens, and who it is (name, revision, depth, architectures, tokenizer), which
    `check` and the engines compare with the verifier they serve beside."""
    cfg = text_config_dict(verifier_config)
    top = getattr(verifier_config, "config", verifier_config)  # a VLM's architectures are outside text_config
    archs = top.get("architectures") if isinstance(top, dict) else getattr(top, "architectures", None)
    layers = int(cfg["num_hidden_layers"])
    return dict(
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_parameters=drafter_rope(cfg),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        target_hidden_size=int(cfg["hidden_size"]),
        aux_hidden_state_indices=check_aux_indices(aux_indices or default_aux_indices(layers), layers),
        verifier_name_or_path=name_or_path or cfg.get("_name_or_path") or None,
        verifier_revision=revision,
        verifier_num_hidden_layers=layers,
        verifier_architectures=list(archs) if archs else None,
        tokenizer_fingerprint=tokenizer_fingerprint,
    )
