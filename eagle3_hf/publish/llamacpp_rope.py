"""`check --engine llamacpp`'s RoPE rule: the drafter's rotary embedding as llama.cpp computes it, against
transformers' (what training used).

Read in llama.cpp 0c1e570 (the tree `make llamacpp` builds). The converter (`conversion/base.py`,
`TextModel.set_gguf_parameters`) writes `rope_theta` as the frequency base and, by `rope_type`: linear, its factor;
yarn, its factor, `original_max_position_embeddings`, `attention_factor` (else `attn_factor`), `beta_fast` and
`beta_slow` (`mscale` and `mscale_all_dim` are not written: the line is commented out); llama3, nothing, but
`conversion/llama.py` (`generate_extra_tensors`) writes the per-frequency divisors as `rope_freqs.weight`, which
the EAGLE-3 graph passes to `ggml_rope_ext` (`src/models/eagle3.cpp`). Loading, `llama_model::load_hparams`
(`src/llama-model.cpp`) reads the base, the scaling type and factor and the original context, and the EAGLE-3
arch's own `load_arch_hparams` (`src/models/eagle3.cpp`) reads none of the YaRN keys, so `beta_fast` and
`beta_slow` stay at 32 and 1 (`src/llama-hparams.h`). The context (`llama_context`, `src/llama-context.cpp`) then sets
YaRN's attention factor to `get_mscale(factor, 1)`, divided by the `1 + 0.1·ln factor` that ggml's `rope_yarn`
(`ggml/src/ggml-cpu/ops.cpp`) multiplies back: cos and sin are scaled by `0.1·ln factor + 1`, whatever
`attention_factor`, `mscale` or `mscale_all_dim` say (DeepSeek's `rope_yarn_log_mul` is read by deepseek2.cpp's
loader only). ggml's YaRN ramp (`ggml_rope_yarn_corr_dims`, floor and ceil of the correction range, then a linear
ramp between them) is transformers' with `truncate` true.

So default, linear and llama3 are computed as transformers does; YaRN equals it only with transformers' scaling
`0.1·ln factor + 1` (no `attention_factor`, no non-zero `mscale` pair that changes it) and beta_fast 32, beta_slow
1, truncate true. Kimi-K2.5 (scaling 1.0, beta_fast 1) and DeepSeek-V3 (scaling 1.0) are refused.
(tests/publish/test_llamacpp_rope.py computes both sides for the five reference verifiers' drafters.)
"""

from __future__ import annotations

import math
from typing import Any

from .llamacpp_rules import LLAMACPP, VERSION
from .report import Report
from .rope_rules import get_mscale, transformers_scaling

BETA_FAST, BETA_SLOW = 32.0, 1.0  # src/llama-hparams.h: what the EAGLE-3 arch keeps (it reads no YaRN key)
COMPUTED_AS_TRANSFORMERS = ("default", "linear", "llama3")
SOURCE = ("conversion/base.py set_gguf_parameters; src/models/eagle3.cpp load_arch_hparams; src/llama-context.cpp "
          f"llama_context; ggml/src/ggml-cpu/ops.cpp rope_yarn, {VERSION}")


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The drafter's RoPE as the converter reads it: `rope_parameters`, else the legacy `rope_scaling` (plus
    `rope_theta`); an empty dict means the default RoPE."""
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if isinstance(value, dict) and value:
            params = dict(value)
            params.setdefault("rope_type", params.get("type", "default"))
            return params
    return {"rope_type": "default"}


def llamacpp_yarn_scaling(p: dict[str, Any]) -> float:
    """The factor llama.cpp multiplies cos and sin by for a YaRN drafter (module docstring)."""
    return get_mscale(float(p["factor"]))


def check_llamacpp_rope(cfg: dict[str, Any], rep: Report) -> None:
    """An error when llama.cpp computes another RoPE than training did; a warning for a type not read here."""
    if "llamacpp" not in rep.engines:
        return
    p = rope_parameters(cfg)
    kind = str(p["rope_type"])
    if kind in COMPUTED_AS_TRANSFORMERS:
        return
    if kind != "yarn" or p.get("factor") is None:
        rep.add("warning", "llamacpp-rope", f"RoPE type {kind}: how llama.cpp computes it for an EAGLE-3 drafter was "
                f"not read here ({VERSION}; read: {', '.join(COMPUTED_AS_TRANSFORMERS)}, yarn)", LLAMACPP)
        return
    trained, served = transformers_scaling(p), llamacpp_yarn_scaling(p)
    differ = []
    if not math.isclose(trained, served, rel_tol=1e-6):
        differ.append(f"attention scaling {served:.3f} (0.1·ln {float(p['factor']):g} + 1; attention_factor, mscale "
                      f"and mscale_all_dim are not read) where training used {trained:.3f}: every q·k scaled by "
                      f"{(served / trained) ** 2:.3g}")
    betas = (float(p.get("beta_fast", BETA_FAST)), float(p.get("beta_slow", BETA_SLOW)))
    if betas != (BETA_FAST, BETA_SLOW):
        differ.append(f"YaRN's ramp between beta_fast {BETA_FAST:g} and beta_slow {BETA_SLOW:g} (the EAGLE-3 "
                      f"loader reads neither) where training used {betas[0]:g} and {betas[1]:g}: other frequencies")
    if p.get("truncate") is False:
        differ.append("a correction range rounded to whole dimensions where training used truncate false")
    if differ:
        rep.add("error", "llamacpp-rope", f"llama.cpp computes this drafter's YaRN RoPE otherwise than training did: "
                f"{'; '.join(differ)} ({SOURCE}); serve it with vLLM 0.30.0 or later", LLAMACPP)
