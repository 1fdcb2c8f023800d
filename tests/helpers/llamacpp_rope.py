"""The drafter's RoPE as llama.cpp computes it, in float64, step by step as its source does (eagle3_hf/publish/
llamacpp_rope.py cites each file): the converter's GGUF keys, the loader's and the context's parameters, then ggml's
rope cache (`ggml_rope_cache_init`, `rope_yarn`, `ggml_rope_yarn_corr_dims`). Returns the factor cos and sin are
multiplied by and the angle per unit position of each frequency pair. (llama.cpp rotates adjacent pairs; its
converter permutes q and k rows so that those pairs are transformers' half-split ones: the same rotation.)"""

from __future__ import annotations

import math

from eagle3_hf.publish.llamacpp_rope import BETA_FAST, BETA_SLOW, rope_parameters


def gguf_keys(cfg: dict) -> dict:
    """What conversion/base.py set_gguf_parameters and conversion/llama.py generate_extra_tensors write."""
    p = rope_parameters(cfg)
    n_dims = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    keys = {"freq_base": float(p.get("rope_theta", cfg.get("rope_theta", 10000.0))), "n_dims": n_dims,
            "scaling_type": "linear", "factor": 0.0, "freq_factors": None}  # the loader's defaults
    kind = p["rope_type"]
    if kind in ("linear", "yarn"):
        keys.update(scaling_type=kind, factor=float(p["factor"]))
    if kind == "yarn":
        keys["n_ctx_orig"] = int(p["original_max_position_embeddings"])
    if kind == "llama3":
        base, factor = keys["freq_base"], float(p.get("factor", 8.0))
        low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
        old = float(p.get("original_max_position_embeddings", 8192))
        factors = []
        for i in range(0, n_dims, 2):
            wavelen = 2 * math.pi * base ** (i / n_dims)
            if wavelen < old / high:
                factors.append(1.0)
            elif wavelen > old / low:
                factors.append(factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        keys["freq_factors"] = factors
    return keys


def llamacpp_rope(cfg: dict) -> tuple[float, list[float]]:
    """(cos/sin scaling, angle per position of each pair) for the drafter config `cfg`."""
    k = gguf_keys(cfg)
    freq_scale = 1.0 / k["factor"] if k["factor"] else 1.0  # llama_model::load_hparams
    yarn = k["scaling_type"] == "yarn"
    ext_factor = 1.0 if yarn else 0.0  # llama_context: yarn_ext_factor -1 -> 1 for YaRN
    attn_factor = 1.0
    if yarn:
        factor = 1.0 / freq_scale
        attn_factor = (0.1 * math.log(factor) + 1.0) / (1.0 + 0.1 * math.log(factor))  # rope_yarn_log_mul 0
    n_dims, base = k["n_dims"], k["freq_base"]
    corr = (0.0, 0.0)
    if yarn:
        def corr_dim(n_rot: float) -> float:
            return n_dims * math.log(k["n_ctx_orig"] / (n_rot * 2 * math.pi)) / (2 * math.log(base))
        corr = (max(0.0, math.floor(corr_dim(BETA_FAST))), min(n_dims - 1.0, math.ceil(corr_dim(BETA_SLOW))))
    mscale = attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale)) if ext_factor else attn_factor
    angles = []
    for i0 in range(0, n_dims, 2):
        ff = k["freq_factors"][i0 // 2] if k["freq_factors"] else 1.0
        extrap = base ** (-i0 / n_dims) / ff
        interp = freq_scale * extrap
        theta = interp
        if ext_factor:
            y = (i0 // 2 - corr[0]) / max(0.001, corr[1] - corr[0])
            ramp = (1 - min(1.0, max(0.0, y))) * ext_factor
            theta = interp * (1 - ramp) + extrap * ramp
        angles.append(theta)
    return mscale, angles
