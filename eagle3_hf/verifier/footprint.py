"""What a verifier's weights take in memory, read from its config and safetensors index without loading a weight,
and how many GPUs hold them.

`extract` (transformers) and `plan` refuse a route whose memory cannot hold the verifier before anything loads, and
the model card's serve commands take their tensor-parallel size from it. The bytes come from, in order of trust:

- a quantized checkpoint (`quantization_config`): the bytes it stores (the index's `metadata.total_size`, or a
  single file's header), since transformers and the engines keep the quantized weights as stored; without those
  files, an estimate from the config: the quantized linear weights at their bits (plus one bf16 scale per group),
  the modules the config's `ignore` list names at the checkpoint's dtype;
- otherwise the parameters (the stored bytes over the stored element size, or counted from the config's sizes,
  the larger of the two) times the element size of the dtype the route loads in.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .family import text_config

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
               "float8_e4m3fn": 1, "fp8": 1}
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                     "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
# one module of each kind, named as DeepSeek-V3-style checkpoints name them, to match a quantization `ignore` list
MODULE_NAMES = {"attention": "model.layers.1.self_attn.q_b_proj", "dense_ffn": "model.layers.0.mlp.gate_proj",
                "shared_experts": "model.layers.1.mlp.shared_experts.gate_proj",
                "routed_experts": "model.layers.1.mlp.experts.0.gate_proj", "lm_head": "lm_head"}
# a GPU holds an engine's share of the weights when they take at most this fraction of it: the rest is the KV
# cache, activations and the CUDA context (vLLM's default --gpu-memory-utilization is 0.9)
WEIGHT_FRACTION = 0.8
MAX_POWER = 64  # engines shard over a power of two GPUs (attention heads divide by it); beyond this: say so


def verifier_parts(cfg: dict[str, Any]) -> dict[str, float]:
    """Parameters of a decoder LM by kind (dense or MoE; MLA or GQA attention): attention, dense FFN, shared and
    routed experts, router, lm_head, embedding."""
    h, layers, vocab = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    nh = int(cfg["num_attention_heads"])
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V3, Kimi-K2)
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        q_lora = cfg.get("q_lora_rank")
        q = h * int(q_lora) + int(q_lora) * nh * qk if q_lora else h * nh * qk
        kv_lora = int(cfg["kv_lora_rank"])
        attn = (q + h * (kv_lora + int(cfg["qk_rope_head_dim"])) + kv_lora * nh * (int(cfg["qk_nope_head_dim"])
                + int(cfg["v_head_dim"])) + nh * int(cfg["v_head_dim"]) * h)
    else:
        hd = int(cfg.get("head_dim") or h // nh)
        attn = 2 * h * nh * hd + 2 * h * int(cfg.get("num_key_value_heads") or nh) * hd
    dense_ffn = 3 * h * int(cfg["intermediate_size"])
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    parts = {"attention": layers * attn, "dense_ffn": layers * dense_ffn, "shared_experts": 0, "routed_experts": 0,
             "router": 0, "routed_active": 0, "lm_head": vocab * h,
             "embedding": 0 if cfg.get("tie_word_embeddings") else vocab * h}
    if experts:
        moe_i = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        shared, topk = int(cfg.get("n_shared_experts") or 0), int(cfg["num_experts_per_tok"])
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        moe_layers = layers - dense_layers
        parts.update(dense_ffn=dense_layers * dense_ffn, shared_experts=moe_layers * shared * 3 * h * moe_i,
                     routed_experts=moe_layers * experts * 3 * h * moe_i, router=moe_layers * h * experts,
                     routed_active=moe_layers * topk * 3 * h * moe_i)
    return {k: float(v) for k, v in parts.items()}


def verifier_params(cfg: dict[str, Any]) -> dict[str, float]:
    """Total and per-token active parameters of a decoder LM. Active = attention + dense FFN layers + for MoE layers
    the shared and top-k routed experts and the router, + lm_head; the embedding lookup does no FLOPs and is counted
    in total only."""
    p = verifier_parts(cfg)
    common = p["attention"] + p["dense_ffn"] + p["shared_experts"] + p["router"] + p["lm_head"]
    return {"total": common + p["routed_experts"] + p["embedding"], "active": common + p["routed_active"]}


@dataclass(frozen=True)
class Footprint:
    """The verifier's weights in memory: bytes, what they are in, and where the number comes from."""

    bytes: float
    dtype: str  # "bfloat16", or "INT4 ..., compressed-tensors" for a quantized checkpoint
    source: str  # "the safetensors index", "config sizes", ...
    quantized: str | None = None  # the quantization method, when there is one

    def describe(self) -> str:
        return f"{self.bytes / 1e9:,.1f} GB ({self.dtype}, from {self.source})"


def config_dtype(config: dict[str, Any]) -> str:
    """The dtype a checkpoint stores (and transformers' dtype="auto" loads): its config's, else float32."""
    for cfg in (config, text_config(config)):
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if value:
            return str(value).replace("torch.", "")
    return "float32"


def dtype_bytes(dtype: str) -> int:
    name = str(dtype).replace("torch.", "").lower()
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (one of {', '.join(sorted(DTYPE_BYTES))})")
    return DTYPE_BYTES[name]


def _ignored(kind: str, ignore: list[str]) -> bool:
    name = MODULE_NAMES[kind]
    for entry in ignore:
        if entry.startswith("re:") and re.match(entry[3:], name):
            return True
        if not entry.startswith("re:") and (name == entry or name.endswith("." + entry)):
            return True
    return False


def quantized_weight_bytes(q: dict[str, Any]) -> tuple[float, str]:
    """Bytes per quantized weight (with one bf16 scale per group) and a name for it, from a quantization_config."""
    method = str(q.get("quant_method") or "quantized")
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    weights = (groups[0].get("weights") or {}) if groups else {}
    bits = weights.get("num_bits") or q.get("bits") or (4 if q.get("load_in_4bit") else 8)
    group = weights.get("group_size") or q.get("group_size")
    kind = str(weights.get("type") or ("float" if method == "fp8" else "int")).upper()
    per = int(bits) / 8 + (2 / int(group) if group and int(group) > 0 else 0)
    return per, f"{kind}{bits}" + (f" in groups of {group}" if group else "") + f", {method}"


def estimate_from_config(config: dict[str, Any], dtype: str) -> Footprint:
    """The weights' bytes from the config's sizes alone (module docstring)."""
    text = text_config(config)
    parts = verifier_parts(text)
    q = config.get("quantization_config") or text.get("quantization_config")
    if not q:
        total = sum(v for k, v in parts.items() if k != "routed_active")
        return Footprint(total * dtype_bytes(dtype), dtype, "config sizes")
    per, name = quantized_weight_bytes(q)
    plain = dtype_bytes(config_dtype(config) if config_dtype(config) != "float32" else "bfloat16")
    ignore = [str(x) for x in q.get("ignore") or q.get("modules_to_not_convert") or []]
    quantized = [k for k in MODULE_NAMES if not _ignored(k, ignore)]
    kept = [k for k in parts if k not in quantized and k != "routed_active"]
    total = sum(parts[k] for k in quantized) * per + sum(parts[k] for k in kept) * plain
    what = ", ".join(k.replace("_", " ") for k in quantized if parts[k])
    return Footprint(total, f"{what} {name}", "config sizes", str(q.get("quant_method") or "quantized"))


def stored_bytes(folder: Path) -> float | None:
    """What a local checkpoint stores: its index's total_size, else the tensors of its single safetensors file (the
    header only is read)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        total = (json.loads(index.read_text(encoding="utf-8")).get("metadata") or {}).get("total_size")
        return float(total) if total else None
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    with open(single, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return float(sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"))


def footprint(config: dict[str, Any], dtype: str = "auto", stored: float | None = None,
              stored_from: str = "the safetensors index") -> Footprint:
    """The verifier's weights loaded in `dtype` ("auto": the checkpoint's), from its config.json dict and, when
    known, the bytes its safetensors store (module docstring)."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config")
    name = config_dtype(config) if dtype in (None, "auto") else str(dtype).replace("torch.", "")
    try:
        estimate: Footprint | None = estimate_from_config(config, name)
    except (KeyError, TypeError, ValueError):  # not a decoder LM config we can size
        estimate = None
    if q and stored:
        assert estimate is None or estimate.quantized
        return Footprint(stored, estimate.dtype if estimate else f"quantized, {q.get('quant_method')}", stored_from,
                         str(q.get("quant_method") or "quantized"))
    if stored and not q:
        scaled = stored * dtype_bytes(name) / dtype_bytes(config_dtype(config))
        if estimate is None or scaled >= estimate.bytes:
            return Footprint(scaled, name, stored_from)
    if estimate is None:
        raise ValueError("cannot size this verifier: its config has no decoder sizes and no safetensors were read")
    return estimate


def checkpoint_footprint(name_or_path: str, dtype: str = "auto", revision: str | None = None) -> Footprint:
    """`footprint` of a local directory or a Hub repo (config.json and the index only: never a weight file)."""
    from .checkpoint_files import INDEX_FILE, CheckpointFiles

    files = CheckpointFiles(name_or_path, revision)
    config = files.config()
    if files.local.is_dir():
        return footprint(config, dtype, stored_bytes(files.local))
    index = files.fetch(INDEX_FILE)
    stored = None
    if index is not None:
        stored = (json.loads(index.read_text(encoding="utf-8")).get("metadata") or {}).get("total_size")
    return footprint(config, dtype, float(stored) if stored else None)


def engine_gpus(weight_bytes: float, gpu_bytes: float, fraction: float = WEIGHT_FRACTION) -> int:
    """The fewest GPUs, a power of two, whose memory at `fraction` holds the weights (tensor parallel over them)."""
    need = max(1, math.ceil(weight_bytes / (fraction * gpu_bytes)))
    return 1 << (need - 1).bit_length()
