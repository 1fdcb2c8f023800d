"""Runs inside the vLLM venv: an engine's own rotary embedding for drafter directories, as its Llama drafter builds it.

Usage: python engine_rope_runner.py REQUEST.json RESULT.json, with REQUEST {"engine": "vllm" | "sglang",
"drafters": {name: {"path": dir, "positions": [...]}}}. Imports only the standard library, torch and the engine.

- vLLM: `vllm.transformers_utils.config.get_config` reads config.json as vLLM's loader does, and
  `get_rope(head_dim, max_position=max_position_embeddings, rope_parameters=config.rope_parameters,
  is_neox_style=True)` is the call of `LlamaAttention._init_rotary_emb` (`model_executor/models/llama.py`), which
  `llama_eagle3.py`'s decoder layer inherits. The call needs a current vLLM config (CustomOp); a default CPU one.
- SGLang: its package from the wheel (scripts/install_sglang_rope.sh), run on this venv's interpreter, whose
  transformers is the version the SGLang wheel pins. config.json is read by `AutoConfig.from_pretrained`, all that
  SGLang's `HfModelConfigParser.parse` (`srt/utils/hf_transformers/config.py`) does for a Llama config (its own
  module pulls in the multimodal configs, which need torchvision). `sglang.srt.layers.rotary_embedding` is imported
  as SGLang imports it (no GPU kernel loads on a CPU) and its `get_rope` called with the arguments of
  `LlamaDecoderLayer.__init__` / `LlamaAttention.__init__` (`models/llama.py`, inherited by `llama_eagle3.py`):
  `rope_parameters` (else `rope_theta` / `rope_scaling`), `partial_rotary_factor`, `rope_is_neox_style`,
  `max_position_embeddings`.

Per drafter: the module's class, its `mscale` attribute where it has one (the YaRN attention scaling), its
`cos_sin_cache` rows at the positions (fp32), and one head of q and k rotated by its `forward_native` (the
PyTorch path the engines' kernels compute the same formula as) from inputs made here and returned with the result.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch


def _vllm_rope(path: str) -> tuple[Any, int]:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config

    config = get_config(path, trust_remote_code=False)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rope = get_rope(head_dim, max_position=getattr(config, "max_position_embeddings", 8192),
                        rope_parameters=getattr(config, "rope_parameters", None), is_neox_style=True)
    return rope, head_dim


def _sglang_rope(path: str) -> tuple[Any, int]:
    from sglang.srt.layers.rotary_embedding import get_rope
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    rope_parameters = getattr(config, "rope_parameters", None)
    if rope_parameters is not None:
        rope_theta, rope_scaling = rope_parameters.get("rope_theta", 10000), rope_parameters
    else:
        rope_theta, rope_scaling = getattr(config, "rope_theta", 10000), getattr(config, "rope_scaling", None)
    if rope_scaling is not None and getattr(config, "original_max_position_embeddings", None):
        rope_scaling["original_max_position_embeddings"] = config.original_max_position_embeddings
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    rotary_dim = int(getattr(config, "partial_rotary_factor", 1) * head_dim)
    rope = get_rope(head_dim, rotary_dim=rotary_dim, max_position=getattr(config, "max_position_embeddings", 8192),
                    base=rope_theta, rope_scaling=rope_scaling,
                    is_neox_style=getattr(config, "rope_is_neox_style", True))
    return rope, head_dim


def probe(engine: str, path: str, positions: list[int]) -> dict[str, Any]:
    rope, head_dim = (_vllm_rope if engine == "vllm" else _sglang_rope)(path)
    positions = [p for p in positions if p < rope.cos_sin_cache.shape[0]]  # the positions its cache holds
    pos = torch.tensor(positions, dtype=torch.long)
    rows = rope.cos_sin_cache.index_select(0, pos).float()
    dims = torch.arange(head_dim, dtype=torch.float32)
    steps = pos.to(torch.float32)[:, None]
    q = torch.sin(0.37 * (dims + 1) + 0.11 * steps)  # [T, head_dim]: one head, the same inputs for every side
    k = torch.cos(0.23 * (dims + 2) - 0.07 * steps)
    q_rot, k_rot = rope.forward_native(pos, q.clone(), k.clone())
    mscale = getattr(rope, "mscale", None)
    return {"class": type(rope).__name__, "mscale": None if mscale is None else float(mscale),
            "rotary_dim": int(rope.rotary_dim), "is_neox_style": bool(rope.is_neox_style),
            "cache_len": int(rope.cos_sin_cache.shape[0]), "positions": positions,
            "cos_sin": rows.tolist(), "q": q.tolist(), "k": k.tolist(),
            "q_rot": q_rot.reshape(len(positions), head_dim).tolist(),
            "k_rot": k_rot.reshape(len(positions), head_dim).tolist()}


def main() -> None:
    request = json.loads(open(sys.argv[1], encoding="utf-8").read())
    result: dict[str, Any] = {"engine": request["engine"], "drafters": {}}
    try:
        if request["engine"] == "vllm":
            import vllm

            result["version"] = vllm.__version__
        else:
            import importlib.metadata

            result["version"] = importlib.metadata.version("sglang")
        for name, item in request["drafters"].items():
            result["drafters"][name] = probe(request["engine"], item["path"], [int(p) for p in item["positions"]])
    except Exception as exc:  # noqa: BLE001 - reported to the caller whole
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
