"""The drafter's rotary embedding as transformers computes it in training and as each engine computes it in serving,
and the assertion that they are equal within fp32 rounding.

`assert_rope_equal(drafter_dir)` is the one call a test needs: it reads the exported config.json, computes the RoPE
with transformers (`LlamaRotaryEmbedding(Eagle3Config)`, what `Eagle3DraftModel` trains with) and with each engine's
own code in the vLLM venv (tests/helpers/engine_rope_runner.py: vLLM's `get_rope`, SGLang's from its wheel), and
compares the attention scaling, the inverse frequencies, cos/sin at positions across the context and q, k rotated.
llama.cpp is not an engine here yet; docs/contracts.md's RoPE table has its row to fill.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from eagle3_hf.engines.vllm.vllm_env import vllm_environment, vllm_python, vllm_venv

from tests.helpers.vllm import skipping_vllm, vllm_or_fail

RUNNER = Path(__file__).resolve().parent / "engine_rope_runner.py"
ENGINES = ("vllm", "sglang")
SGLANG_STAMP = ".eagle3_hf_sglang_rope"
# positions across the context: the first ones, both sides of the original (pre-YaRN / llama3) context, far out
POSITIONS = (0, 1, 2, 3, 7, 100, 1000, 4095, 4096, 4097, 8191, 8192, 8193, 32767, 40959, 131071, 163839, 262143)
# fp32 rounding: cos/sin agree to a few ulps of their argument pos * inv_freq, whose rounding grows with pos
ULP = float(torch.finfo(torch.float32).eps)


def sglang_rope_dir() -> Path:
    """Where scripts/install_sglang_rope.sh unpacks SGLang (`$EAGLE3_HF_SGLANG_ROPE` overrides)."""
    root = os.environ.get("EAGLE3_HF_SGLANG_ROPE")
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return Path(root).expanduser() if root else Path(cache) / "eagle3_hf" / "sglang-rope"


def engine_or_fail(engine: str) -> None:
    """As `vllm_or_fail` (both run on the vLLM venv's interpreter), and SGLang's unpacked wheel for SGLang."""
    vllm_or_fail()
    if engine == "sglang" and not (sglang_rope_dir() / SGLANG_STAMP).is_file():
        pytest.fail(f"SGLang's rotary embedding is not installed in {sglang_rope_dir()}: run `make sglang-rope`")


@dataclass
class Rope:
    """One side's RoPE for one drafter: attention scaling, inverse frequencies [D/2], cos/sin [T, D] at
    `positions`, and q, k [T, D] (one head) after rotation."""

    scaling: float
    inv_freq: torch.Tensor
    positions: list[int]
    cos: torch.Tensor
    sin: torch.Tensor
    q_rot: torch.Tensor
    k_rot: torch.Tensor


def transformers_rope(drafter_dir: str | Path, positions: list[int], q: torch.Tensor, k: torch.Tensor) -> Rope:
    """What training computes: the drafter's `LlamaRotaryEmbedding` built from its exported config (as
    `Eagle3DraftModel.__init__` builds it) and transformers' `apply_rotary_pos_emb`, in fp32."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from eagle3_hf.model.configuration_eagle3 import Eagle3Config

    rotary = LlamaRotaryEmbedding(Eagle3Config.from_pretrained(drafter_dir))
    pos = torch.tensor([positions], dtype=torch.long)
    cos, sin = rotary(q[None], pos)  # [1, T, D], attention scaling applied
    q_rot, k_rot = apply_rotary_pos_emb(q[None, None], k[None, None], cos, sin)  # [1, 1, T, D]
    return Rope(float(rotary.attention_scaling), rotary.inv_freq.float(), positions, cos[0], sin[0],
                q_rot[0, 0], k_rot[0, 0])


def _engine_side(result: dict) -> Rope:
    """An engine's cos_sin_cache rows hold [scaling * cos(pos * inv_freq), scaling * sin(...)] for half the
    dimensions (neox style repeats them): position 1's row gives back its scaling and inverse frequencies."""
    rows = torch.tensor(result["cos_sin"], dtype=torch.float32)
    half = rows.shape[1] // 2
    cos, sin = rows[:, :half], rows[:, half:]
    at1 = result["positions"].index(1)
    inv_freq = torch.atan2(sin[at1], cos[at1])
    scaling = result["mscale"] if result["mscale"] is not None else float(torch.hypot(cos[at1], sin[at1]).mean())
    full = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return Rope(scaling, inv_freq, result["positions"], full[0], full[1],
                torch.tensor(result["q_rot"]), torch.tensor(result["k_rot"]))


def engine_ropes(engine: str, drafters: dict[str, Path], timeout: float = 600) -> dict:
    """Run the engine's own RoPE for each drafter (name -> directory) in one process in the vLLM venv; the runner's
    result per name (engine_rope_runner.py), with the engine's version under "version"."""
    engine_or_fail(engine)
    items = {}
    for name, path in drafters.items():
        cfg = json.loads((Path(path) / "config.json").read_text())
        top = int(cfg.get("max_position_embeddings", 8192))
        items[name] = {"path": str(path), "positions": [p for p in POSITIONS if p < top]}
    env = vllm_environment(vllm_venv(), threads=1, offline=True)
    if engine == "sglang":
        env["PYTHONPATH"] = str(sglang_rope_dir() / "site")
    with tempfile.TemporaryDirectory(prefix="eagle3_rope_") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps({"engine": engine, "drafters": items}))
        # -P: the runner's directory stays off sys.path (tests/helpers/vllm.py would shadow the vllm package)
        proc = subprocess.run([str(vllm_python()), "-P", str(RUNNER), str(req), str(res)], env=env, capture_output=True,
                              text=True, timeout=timeout)
        assert res.is_file(), f"{engine} RoPE runner ended without a result: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        result = json.loads(res.read_text())
    assert "error" not in result, f"{engine}: {result.get('error')}\n{result.get('traceback', '')}"
    return result


def assert_same_rope(ours: Rope, theirs: Rope, what: str) -> None:
    """Equal within fp32 rounding: scaling and inverse frequencies to a few ulps; cos/sin and rotated q, k to a few
    ulps of their argument pos * inv_freq (times the scaling), which is where fp32 rounding lands at position pos."""
    assert math.isclose(ours.scaling, theirs.scaling, rel_tol=4 * ULP), \
        f"{what}: attention scaling {theirs.scaling!r} vs transformers' {ours.scaling!r}"
    torch.testing.assert_close(theirs.inv_freq, ours.inv_freq, rtol=8 * ULP, atol=0,
                               msg=lambda m: f"{what}: inverse frequencies differ: {m}")
    pos = torch.tensor(ours.positions, dtype=torch.float32)[:, None]
    bound = ours.scaling * (8 * ULP * (1 + pos * float(ours.inv_freq.max())))  # [T, 1]
    for name, a, b in (("cos", theirs.cos, ours.cos), ("sin", theirs.sin, ours.sin)):
        gap = (a - b).abs()
        assert bool((gap <= bound).all()), f"{what}: {name} differs by up to {float(gap.max()):.3g} " \
            f"(at position {ours.positions[int(gap.max(dim=1).values.argmax())]})"
    for name, a, b in (("q", theirs.q_rot, ours.q_rot), ("k", theirs.k_rot, ours.k_rot)):
        gap = (a - b).abs()
        assert bool((gap <= 4 * bound).all()), f"{what}: rotated {name} differs by up to {float(gap.max()):.3g}"


def compare(engine: str, drafters: dict[str, Path]) -> tuple[str, dict[str, tuple[Rope, Rope]]]:
    """The engine's version, and (transformers', the engine's) RoPE per drafter name, computed on the same q, k."""
    result = engine_ropes(engine, drafters)
    out = {}
    for name, path in drafters.items():
        side = result["drafters"][name]
        q, k = torch.tensor(side["q"]), torch.tensor(side["k"])
        out[name] = (transformers_rope(path, side["positions"], q, k), _engine_side(side))
    return result["version"], out


def assert_rope_equal(drafter_dir: str | Path, engines: tuple[str, ...] = ENGINES) -> None:
    """The drafter at `drafter_dir` gets the same RoPE from transformers (training) and from each engine's own code
    (serving), within fp32 rounding; fails naming the engine and what differs. Skipped with EAGLE3_HF_SKIP_VLLM."""
    if skipping_vllm():
        pytest.skip("EAGLE3_HF_SKIP_VLLM is set: the engines' RoPE runs in the vLLM venv")
    for engine in engines:
        version, pairs = compare(engine, {"drafter": Path(drafter_dir)})
        ours, theirs = pairs["drafter"]
        assert_same_rope(ours, theirs, f"{engine} {version} on {drafter_dir}")
