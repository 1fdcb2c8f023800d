"""Tiny drafters for tests: hand-written checkpoints in the published shapes, and our model class at the
same sizes.

Hand-written, without our model class: `write_drafter` writes a standard-layout checkpoint (config.json +
model.safetensors) that passes `eagle3-hf check`; its keyword arguments break it in one place at a time.
`kimi_k2_config` and `speculators_config` mirror the config shapes of published Kimi-K2 drafters and of the
speculators layout.

With our model class: `tiny_model` (a drafter for an 8-layer verifier of vocabulary VOCAB) with `packed_batch`
rows to feed it, `random_drafter` for any verifier, and STANDARD_KEYS, the exact tensor names of the standard
layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from eagle3_hf import Eagle3Config, Eagle3DraftModel

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 128, 1000, 100
VERIFIER_LAYERS = 8
AUX = [2, 4, 5]  # transformers output_hidden_states indices for an 8-layer verifier


def standard_config(**overrides: Any) -> dict[str, Any]:
    """What Eagle3Config.save_pretrained writes (docs/contracts.md, checkpoint layout), tiny."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HIDDEN // HEADS, "hidden_act": "silu",
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": HIDDEN,
        "rms_norm_eps": 1e-6, "initializer_range": 0.02, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "eagle_aux_hidden_state_layer_ids": list(AUX),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX], "use_aux_hidden_state": True},
        "norm_before_residual": False, "verifier_num_hidden_layers": VERIFIER_LAYERS,
        "verifier_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "verifier_architectures": ["LlamaForCausalLM"],
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not ...}  # `key=...` deletes a key


def vocab_mapping(vocab: int = VOCAB, draft_vocab: int = DRAFT_VOCAB, seed: int = 0):
    kept = torch.sort(torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab), t2d


def standard_tensors(cfg: dict[str, Any], seed: int = 0, embed: bool = False) -> dict[str, torch.Tensor]:
    """Weights with a trained look: rows of lm_head have uneven norms, as frequent tokens do after training."""
    g = torch.Generator().manual_seed(seed)
    h, t, i = cfg["hidden_size"], cfg.get("target_hidden_size", cfg["hidden_size"]), cfg["intermediate_size"]
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dv, v = cfg["draft_vocab_size"], cfg["vocab_size"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    d2t, t2d = vocab_mapping(v, dv, seed)
    out = {
        "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rand(i, h), "midlayer.mlp.up_proj.weight": rand(i, h),
        "midlayer.mlp.down_proj.weight": rand(h, i), "midlayer.input_layernorm.weight": 1 + rand(h),
        "midlayer.hidden_norm.weight": 1 + rand(h), "midlayer.post_attention_layernorm.weight": 1 + rand(h),
        "fc.weight": rand(h, 3 * t), "norm.weight": 1 + rand(h),
        "lm_head.weight": rand(dv, h) * torch.exp(torch.randn(dv, 1, generator=g) * 0.6),
        "d2t": d2t, "t2d": t2d,
    }
    if embed:
        out["embed_tokens.weight"] = rand(v, h) * torch.exp(torch.randn(v, 1, generator=g) * 0.6)
    return out


def write_checkpoint(path: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return path


def write_drafter(path: Path, config: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
                  rename: dict[str, str] | None = None, replace: dict[str, torch.Tensor] | None = None,
                  embed: bool = False, seed: int = 0, **config_overrides: Any) -> Path:
    """A passing checkpoint, or one broken by `drop` / `rename` / `replace` / config overrides."""
    cfg = config or standard_config(**config_overrides)
    tensors = standard_tensors(cfg, seed, embed)
    tensors.update(replace or {})
    for name in drop:
        tensors.pop(name)
    for old, new in (rename or {}).items():
        tensors[new] = tensors.pop(old)
    return write_checkpoint(path, cfg, tensors)


def write_verifier_config(path: Path, **overrides: Any) -> Path:
    """A verifier directory with only config.json (a Llama with VERIFIER_LAYERS layers)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
           "num_hidden_layers": VERIFIER_LAYERS, "vocab_size": VOCAB, "num_attention_heads": HEADS,
           "intermediate_size": INTER}
    cfg.update(overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


KIMI_VOCAB, KIMI_LAYERS = 163840, 61


def kimi_k2_config(hidden: int = HIDDEN, **overrides: Any) -> dict[str, Any]:
    """The shape of a published Kimi-K2 EAGLE-3 drafter config (SpecForge-style export), hidden shrunk.

    Real values: hidden 7168, 56 heads / 8 KV heads, draft vocab 32000, vocab 163840, yarn rope; these
    exports carry `model_type: "kimi_k2"` (or "llama"), SGLang-form ids in eagle_config only, no top-level
    ids and no embed_tokens.
    """
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "kimi_k2", "bos_token_id": 163584,
        "eos_token_id": 163585, "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02,
        "intermediate_size": 2 * hidden, "max_position_embeddings": 131072, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": hidden // 4, "num_hidden_layers": 1, "pretraining_tp": 1,
        "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": KIMI_VOCAB,
        "draft_vocab_size": 32000 if hidden > 1024 else 256,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "use_aux_hidden_state": True,
                         "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                         "use_mtp_layernorm": False},
    }
    cfg.update(overrides)
    return cfg


def kimi_k2_verifier_config(path: Path, hidden: int = HIDDEN) -> Path:
    """A Kimi-K2 verifier directory (config.json only): DeepSeek-V3 architecture, 61 layers."""
    return write_verifier_config(path, architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2",
                                 hidden_size=hidden, num_hidden_layers=KIMI_LAYERS, vocab_size=KIMI_VOCAB,
                                 first_k_dense_replace=1, n_routed_experts=384, kv_lora_rank=512)


def speculators_config(**overrides: Any) -> dict[str, Any]:
    """The speculators layout's config (Eagle3Speculator), tiny; weights are named layers.0.*."""
    layer = {k: v for k, v in standard_config().items()
             if k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "hidden_act", "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta",
                      "initializer_range", "num_hidden_layers", "tie_word_embeddings")}
    cfg = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "transformer_layer_config": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **layer},
        "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": HIDDEN, "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": list(AUX), "verifier_num_hidden_layers": VERIFIER_LAYERS,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                               "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                            "architectures": ["LlamaForCausalLM"]}},
    }
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not ...}


def write_speculators_drafter(path: Path, embed: bool = True, **overrides: Any) -> Path:
    cfg = speculators_config(**overrides)
    tensors = standard_tensors(standard_config(), embed=embed)
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    return write_checkpoint(path, cfg, tensors)


# ---------------------------------------------------------------- drafters of our model class

STANDARD_KEYS = {
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
}


def tiny_config(**overrides) -> Eagle3Config:
    verifier = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2)
    config = Eagle3Config.from_verifier(verifier, draft_vocab_size=DRAFT_VOCAB, **overrides)
    config._attn_implementation = "sdpa"
    return config


def tiny_model(seed: int = 0, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    model = Eagle3DraftModel(tiny_config(**overrides)).eval()
    with torch.no_grad():  # non-trivial norms so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def packed_batch(lengths_per_row, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths_per_row)
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    aux = torch.randn(batch, length, 3 * HIDDEN, generator=g)
    doc = torch.full((batch, length), -1)
    pos = torch.zeros(batch, length, dtype=torch.long)
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for d, n in enumerate(lengths):
            doc[b, start:start + n] = d
            pos[b, start:start + n] = torch.arange(n)
            start += n
    return ids, aux, pos, doc


def random_drafter(verifier, draft_vocab_size: int = 500, seed: int = 0, kept: torch.Tensor | None = None,
                   aux=None, scale: float = 1.0) -> Eagle3DraftModel:
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=draft_vocab_size,
                                        aux_hidden_state_indices=aux)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    drafter = Eagle3DraftModel(config).eval()
    drafter.load_verifier_embeddings(verifier)
    kept = torch.arange(draft_vocab_size) if kept is None else kept  # sorted verifier ids
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    drafter.set_vocab_mapping(kept - torch.arange(draft_vocab_size), t2d)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" not in name and "embed" not in name:
                p.mul_(scale)
    return drafter


def reference_unroll(model, ids, aux, steps):
    """Brute force, one document, one anchor at a time, the way an engine drafts: step 0 over the prefix
    with a causal cache, then steps 1..i appended for that anchor only (cache cropped between anchors)."""
    n = ids.shape[0]
    logits = [torch.full((n, DRAFT_VOCAB), float("nan")) for _ in range(steps)]
    if n < 2:
        return logits
    tokens_next = ids[1:]  # token t+1 pairs with the feature of t
    pos = torch.arange(n - 1)[None]
    step0, hidden0, (k, v) = model.draft_step(tokens_next[None], aux[None, : n - 1], pos)
    for t in range(n - 1):
        logits[0][t] = step0[0, t]
        cache = (k[:, :, : t + 1], v[:, :, : t + 1])
        hidden = hidden0[:, t : t + 1]
        for i in range(1, steps):
            if t + 1 + i >= n:
                break
            out, hidden, cache = model.draft_step(ids[t + 1 + i].view(1, 1), hidden, torch.tensor([[t + i]]), cache)
            logits[i][t] = out[0, 0]
    return logits
