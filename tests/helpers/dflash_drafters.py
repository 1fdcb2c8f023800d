"""Hand-written DFlash drafters in the one layout vLLM, SGLang and llama.cpp all serve (docs/contracts.md, "What
engines read for DFlash"), written without our model class: config.json and model.safetensors with random weights,
for a verifier described by its config. `write_dflash_drafter` writes one that `eagle3-hf check` passes; its
keyword arguments change the config in one place at a time."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from eagle3_hf.verifier.family import default_aux_indices

from tests.helpers.drafters import write_checkpoint


def dflash_config(verifier: dict[str, Any], layers: int = 1, block_size: int = 4, mask_token_id: int | None = None,
                  aux: list[int] | None = None, **overrides: Any) -> dict[str, Any]:
    """A DFlash config for `verifier` (a text config dict): its hidden size, heads and vocabulary, `layers` Qwen3
    layers, aux `output_hidden_states` indices `aux` (default: the project's) written as layer outputs (- 1)."""
    hidden, heads = int(verifier["hidden_size"]), int(verifier["num_attention_heads"])
    aux = aux or default_aux_indices(int(verifier["num_hidden_layers"]))
    theta = float((verifier.get("rope_parameters") or {}).get("rope_theta") or verifier.get("rope_theta") or 1e4)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": int(verifier.get("num_key_value_heads") or heads),
           "head_dim": int(verifier.get("head_dim") or hidden // heads),
           "intermediate_size": int(verifier.get("intermediate_size") or 2 * hidden), "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "attention_bias": False, "vocab_size": int(verifier["vocab_size"]),
           "max_position_embeddings": int(verifier.get("max_position_embeddings") or 2048),
           "tie_word_embeddings": False, "rope_theta": theta,
           "rope_parameters": {"rope_type": "default", "rope_theta": theta},
           "layer_types": ["full_attention"] * layers, "block_size": block_size,
           "dflash_config": {"mask_token_id": int(verifier["vocab_size"]) - 1 if mask_token_id is None
                             else mask_token_id, "target_layer_ids": [i - 1 for i in aux], "block_size": block_size}}
    cfg.update(overrides)
    return cfg


def dflash_tensors(cfg: dict[str, Any], seed: int = 0, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Random weights in the served layout (norm weights 1)."""
    from eagle3_hf.publish.dflash_rules import dflash_shapes

    g = torch.Generator().manual_seed(seed)
    shapes = dflash_shapes(cfg, len((cfg.get("dflash_config") or {}).get("target_layer_ids") or [0, 0, 0]))
    return {name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=g) * scale
            for name, shape in shapes.items()}


def write_dflash_drafter(path: Path, verifier: dict[str, Any], seed: int = 0,
                         extra: dict[str, torch.Tensor] | None = None, **config: Any) -> Path:
    """A DFlash checkpoint for `verifier` in the engines' layout (plus `extra` tensors, to break it)."""
    cfg = dflash_config(verifier, **config)
    tensors = dflash_tensors(cfg, seed)
    tensors.update(extra or {})
    return write_checkpoint(path, cfg, tensors)


ACCEPTING_BLOCK = 5  # the accepting drafter's block: k = 4 drafts per cycle


def accepting_dflash_pair(root: Path, tokenizer, questions: int = 10, alpha: float = 0.4,
                          layers: int = 2) -> tuple[Path, Path]:
    """(verifier dir, drafter dir): a random 6-layer Llama verifier (hidden 256, head_dim 64: vLLM's CPU attention
    refuses head_dim 16) with `tokenizer`, whose greedy answers end repeating one token (on most of the first
    `questions` MT-bench questions the same one), and a DFlash drafter of our own class (block 5) whose mask token
    is the token most of them repeat and whose o_proj / down_proj are scaled by `alpha`: its blocks are accepted
    whole in some cycles and partly or not at all in others, so τ is neither 1 nor k + 1 and the accepted drafts
    per cycle compare the drafter's math across engines (smaller alpha: every draft accepted; larger: none)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_hf.decoding import greedy_generate
    from eagle3_hf.demo_data.prompts import mtbench_questions
    from eagle3_hf.evaluation.evaluate import render_prompt
    from eagle3_hf.model.configuration_dflash import DFlashConfig
    from eagle3_hf.model.modeling_dflash import DFlashDraftModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    verifier = LlamaForCausalLM(config).eval().requires_grad_(False)
    verifier.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    asked = mtbench_questions(questions)
    ends = [greedy_generate(verifier, render_prompt(tokenizer, [{"role": "user", "content": q["turns"][0]}]), 16,
                            eos_token_id=[]).tokens[-1] for q in asked]
    repeated = Counter(ends).most_common(1)[0][0]
    drafter_config = DFlashConfig.from_verifier(verifier.config, mask_token_id=repeated, num_hidden_layers=layers,
                                                block_size=ACCEPTING_BLOCK)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(drafter_config).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.mul_(alpha)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    drafter.load_verifier_embeddings(verifier)
    drafter.save_pretrained(root / "drafter")
    return root / "verifier", root / "drafter"
