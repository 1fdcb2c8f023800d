"""Tiny verifiers built at test time: random Llamas with the SmolLM2 vocabulary (real tokenizer, tiny compute),
one scaled so its greedy output varies with the context, and a 32-token one that is trivially predictable."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def make_tiny_verifier(vocab_size: int = 49152, hidden_size: int = 64, num_layers: int = 6, seed: int = 0):
    """A random Llama with the SmolLM2 vocabulary: real tokenizer, tiny compute."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return model


def lively_verifier(seed: int = 1, **kwargs) -> LlamaForCausalLM:
    """A tiny random Llama (SmolLM2 vocabulary) scaled up so its greedy output varies with the context
    (at the default init every token is the same one, which would hide cache bugs)."""
    verifier = make_tiny_verifier(seed=seed, **kwargs)
    with torch.no_grad():
        for name, p in verifier.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    return verifier


def plus_one_verifier(vocab: int = 32, hidden: int = 64, layers: int = 5) -> LlamaForCausalLM:
    """A Llama whose greedy next token is (token + 1) mod vocab: layers silenced (o_proj, down_proj = 0),
    orthonormal embeddings, lm_head row j = 2 x embedding of j - 1. Trivially predictable by design."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        basis = torch.linalg.qr(torch.randn(hidden, hidden))[0][:vocab]  # [V, H] orthonormal rows
        model.model.embed_tokens.weight.copy_(basis)
        model.lm_head.weight.copy_(2.0 * basis.roll(1, dims=0))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


class ToyTokenizer:
    """Chat rendering for the 32-token verifier: characters folded into its vocabulary."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return [ord(c) % 32 for m in messages for c in m["content"]]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)
