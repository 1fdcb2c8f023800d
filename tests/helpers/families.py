"""Tiny random verifiers of the families EAGLE-3 is served on, built at test time around the SmolLM2 tokenizer.

Each keeps its family's distinguishing parts at toy sizes (hidden 64, 5 layers, SmolLM2's 49152-token
vocabulary, so the vocabulary is large relative to the hidden size as in Gemma):

- deepseek_v3: multi-head latent attention (q/kv LoRA ranks), MoE layers after one dense layer, YaRN RoPE;
- kimi_k25: that DeepSeek-V3 model nested as `text_config` of a multimodal (Kimi-K2.5) config with a vision
  tower, as the reference verifier is published;
- qwen3: q/k norms, GQA, untied embeddings (qwen3_moe: the same with every layer a mixture of experts; not in
  FAMILIES, used where MoE checkpoints matter);
- gemma3: sliding-window and full-attention layers with their own RoPE (nested per-layer-type
  `rope_parameters`), a window shorter than the prompts, sqrt(hidden)-scaled embeddings, soft-capped logits.

The MoE router and the scaled outputs are left random: what is tested is that every stage handles the
architecture, not what a trained model of it would say.
"""

from __future__ import annotations

from pathlib import Path

import torch

NUM_LAYERS = 5  # default aux indices (2, 3, 4): three distinct layers need at least 4
VOCAB = 49152
HIDDEN = 64
FAMILIES = ("deepseek_v3", "kimi_k25", "qwen3", "gemma3")
MOE_FAMILIES = ("deepseek_v3", "kimi_k25", "qwen3_moe")  # their last layer a mixture of experts, stored per expert
LIVELY_SCALE = 8.0


def _deepseek_v3_config(**overrides):
    from transformers import DeepseekV3Config

    kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
              kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2,
              rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                               "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                               "mscale": 1.0, "mscale_all_dim": 1.0})
    kw.update(overrides)
    return DeepseekV3Config(**kw)


# What vLLM 0.32's CPU build needs to load the tiny DeepSeek-V3: the latent size its CPU MLA kernel exists for
# (kv_lora_rank 512 + rope 64, Kimi's own; else "Head dimension 24 is not supported by MLA"), the router fields real
# DeepSeek-V3/Kimi configs carry (without topk_method vLLM creates no e_score_correction_bias: a KeyError), and
# head_dim 128 for a drafter of it.
VLLM_CPU_MLA = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512,
                    qk_rope_head_dim=64, topk_method="noaux_tc", scoring_func="sigmoid")


def family_model(family: str, seed: int = 0, **overrides):
    """A random, frozen verifier of `family` in eval mode; `overrides`: DeepSeek-V3 config fields (VLLM_CPU_MLA)."""
    import transformers as tf

    if overrides and family != "deepseek_v3":
        raise ValueError(f"config overrides are for deepseek_v3, not {family!r}")
    torch.manual_seed(seed)
    if family == "deepseek_v3":
        model = tf.DeepseekV3ForCausalLM(_deepseek_v3_config(**overrides))
    elif family == "kimi_k25":
        vision = dict(patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1, num_attention_heads=2,
                      num_hidden_layers=1, hidden_size=32, intermediate_size=64)
        config = tf.Kimi_K25Config(text_config=_deepseek_v3_config().to_dict(), vision_config=vision,
                                   projection_hidden_size=32, tie_word_embeddings=False)
        model = tf.Kimi_K25ForConditionalGeneration(config)
    elif family == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=2))
    elif family == "qwen3_moe":  # every layer sparse, the last one included
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, pad_token_id=2))
    elif family == "gemma3":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
            sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    else:
        raise ValueError(f"unknown family {family!r} (known: {FAMILIES + ('qwen3_moe',)})")
    with torch.no_grad():  # at the default init every position predicts the same token, hiding cache bugs
        for name, param in model.named_parameters():
            if "norm" not in name and "embed" not in name:
                param.mul_(LIVELY_SCALE)
    return model.float().eval().requires_grad_(False)


def save_family_verifier(family: str, path: Path, tokenizer, seed: int = 0, **overrides):
    """Save the model and the SmolLM2 tokenizer, loadable by path like a Hub checkpoint; returns the model."""
    model = family_model(family, seed, **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def make_learnable(model, kept, damping: float = 0.1, successor: bool = False):
    """Make a random verifier one a drafter learns in seconds (in place; returns it): embeddings N(0, 1), every
    attention and MLP output (o_proj, down_proj, the experts' included) damped so that each final state stays near
    its token's embedding, and lm_head row j the embedding of j for the ids in `kept`, zero elsewhere. Its greedy
    next token is then the current one wherever that is in `kept` (the tokens of its answers: they repeat), and a
    token of `kept` elsewhere (a prompt's last token), after which the answer repeats that token.

    With `successor`, row j is the embedding of the kept id before j (in sorted order, cyclically): the greedy next
    token of a kept token is the next kept id, so answers walk through every kept token instead of repeating one,
    and a drafter's τ on them averages over many transitions it saw in training (a repeated pair it never saw)."""
    with torch.no_grad():
        embed = model.get_input_embeddings().weight.normal_(0, 1.0)
        head = model.get_output_embeddings().weight
        head.zero_()
        ids = torch.tensor(sorted(set(kept)), dtype=torch.long)
        head[ids.roll(1) if successor else ids] = embed[ids]
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                param.mul_(damping)
    return model
