"""The RoPE-relevant fields of five published verifiers' text configs, written here as facts (sizes kept so that
`Eagle3Config.from_verifier` picks the drafter's head_dim and heads as it would for the real model).

- Kimi-K2.5 (moonshotai/Kimi-K2.5, `text_config`, DeepSeek-V3 architecture): examples/recipes/kimi_k25_text_config.json,
  YaRN factor 64 over 4,096 original positions, beta_fast 1, beta_slow 1, mscale 1, mscale_all_dim 1, theta 50,000,
  262,144 positions.
- DeepSeek-V3 (deepseek-ai/DeepSeek-V3): YaRN factor 40 over 4,096, beta_fast 32, beta_slow 1, mscale 1,
  mscale_all_dim 1, theta 10,000, 163,840 positions; MLA with qk_rope_head_dim 64 (the drafter's attention is plain
  GQA with head_dim 128, so its YaRN ramp is over 128 dims: the same in transformers and both engines).
- Llama-3.1-8B: examples/recipes/llama31_8b_text_config.json, llama3 scaling factor 8, low/high frequency factors 1
  and 4 over 8,192 original positions, theta 500,000, 131,072 positions.
- Qwen3-8B: examples/recipes/qwen3_8b_text_config.json, plain RoPE, theta 1,000,000, 40,960 positions.
- Gemma 3 27B (google/gemma-3-27b-it, `text_config`): global (full-attention) layers linear scaling factor 8 at theta
  1,000,000, local (sliding) layers theta 10,000 without scaling (`rope_local_base_freq`), head_dim 128,
  131,072 positions; the drafter takes the global RoPE (docs/verifier_families.md).

None of the five has a partial rotary factor for its attention heads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"


def _recipe(name: str) -> dict[str, Any]:
    cfg = json.loads((RECIPES / name).read_text())
    cfg.pop("_comment", None)
    return cfg


DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
}

GEMMA3_27B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3_text", "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "vocab_size": 262208, "max_position_embeddings": 131072, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 1024, "query_pre_attn_scalar": 168, "hidden_activation": "gelu_pytorch_tanh",
    "bos_token_id": 2, "eos_token_id": 1,
}


def verifier_text_configs() -> dict[str, dict[str, Any]]:
    """Family name -> the verifier's text config as its config.json writes it."""
    return {"kimi_k25": _recipe("kimi_k25_text_config.json"), "deepseek_v3": dict(DEEPSEEK_V3),
            "llama31": _recipe("llama31_8b_text_config.json"), "qwen3": _recipe("qwen3_8b_text_config.json"),
            "gemma3": dict(GEMMA3_27B)}
