"""A verifier vLLM's CPU build serves and a drafter trained for it in seconds: the pair `evaluate --engine vllm`'s
slow tests serve (fixture `served_pair`, tests/evaluation/conftest.py)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# what the session's `evaluate --engine vllm` of the pair decodes (fixture `vllm_evaluation`); the layout test's
# sequential run decodes the same, to compare with it
VLLM_EVALUATION_ARGS = ("--prompts", "mt-bench", "--num-prompts", "4", "--max-new-tokens", "32", "--k", "3")


def next_token_llama(vocab_size: int, hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    """A random frozen tiny Llama (head_dim 64, vLLM's CPU attention supports it) whose lm_head row j is the embedding
    of j - 1: greedy is (token + 1) wherever the final state stays near the token's embedding."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.copy_(torch.roll(embed, shifts=1, dims=0))
    return model


def chain_verifier(vocab_size: int = 49152, hidden: int = 128, layers: int = 6, seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama with the SmolLM2 vocabulary (so the real tokenizer and chat template render prompts) and
    head_dim 64 (vLLM's CPU attention supports it): its lm_head row j is the embedding of j - 1, so its greedy
    next token is mostly (token + 1), and attention and MLP outputs are damped but not silenced, so the
    context still matters a little. A drafter learns it in seconds; a random one scores τ ≈ 1."""
    model = next_token_llama(vocab_size, hidden, layers, seed)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return model


def trained_drafter(verifier, draft_vocab_size: int = 4096, steps: int = 60, ttt_steps: int = 3, seed: int = 0):
    """A few Adam steps of the TTT objective on the verifier's greedy continuations of random prompts over
    the first `draft_vocab_size` ids (the draft vocabulary: vLLM refuses d2t when it is the whole vocabulary)."""
    from tests.helpers.drafters import random_drafter

    drafter = random_drafter(verifier, draft_vocab_size=draft_vocab_size, seed=seed).train()
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    aux = drafter.config.aux_hidden_state_indices
    for _ in range(steps):
        ids = torch.randint(0, draft_vocab_size - 128, (4, 96), generator=g)  # as long as the served prompts
        ids[:, 40:] = ids[:, 39:40] + torch.arange(1, 57)  # a prompt, then a chain like the verifier's answers
        with torch.no_grad():
            out = verifier(ids, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in aux], dim=-1)
        greedy = out.logits.argmax(-1).clamp_max(draft_vocab_size - 1)  # kept ids are 0..N-1: draft id = id
        result = drafter(ids, features, ttt_steps=ttt_steps)
        loss = sum(0.8**i * torch.nn.functional.cross_entropy(logits[valid], torch.roll(greedy, -(1 + i), 1)[valid])
                   for i, (logits, valid) in enumerate(zip(result.logits, result.step_valid)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()
