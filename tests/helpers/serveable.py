"""A tiny verifier vLLM's CPU build serves (head_dim 64), prepared random walks for it, and transformers'
reference states in vLLM's layout: what the vLLM extraction and feature-server tests share."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS, HIDDEN, VOCAB = 6, 128, 49152  # the SmolLM2 vocabulary: the real tokenizer renders, vLLM loads it
BF16_STEP = 2.0**-8  # one rounding to bfloat16 moves a value by at most 2^-9 of it; two independent ones 2^-8


def serveable_verifier(seed: int = 0) -> LlamaForCausalLM:
    """A tiny Llama vLLM's CPU attention accepts (head_dim 64) whose greedy next token is mostly token + 1
    (lm_head = the embedding rolled by one, layer outputs damped), so a drafter learns it in a few epochs.
    Its final norm has a non-constant weight (normed twice != normed once) and its layers move the residual
    stream enough that adjacent ids differ by far more than bf16 rounding."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.copy_(torch.roll(embed, shifts=1, dims=0))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(8.0)
            layer.mlp.down_proj.weight.mul_(8.0)
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


def walk_prepared(path: Path, fingerprint: str, n: int = 12, seed: int = 0) -> Path:
    """Random walks over 200 even ids (greedy targets are then the odd ids next to them); the first 4 tokens
    of each sample are the prompt (no loss)."""
    g = torch.Generator().manual_seed(seed)
    alphabet = torch.arange(1000, 1400, 2)
    ids, tokens, masks = [], [], []
    for i in range(n):
        t = int(torch.randint(12, 41, (1,), generator=g))
        tokens.append(alphabet[torch.randint(0, len(alphabet), (t,), generator=g)].tolist())
        masks.append([0] * 4 + [1] * (t - 4))
        ids.append(f"w{i:03d}")
    features = datasets.Features({"id": datasets.Value("string"),
                                  "input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int8"))})
    datasets.Dataset.from_dict({"id": ids, "input_ids": tokens, "loss_mask": masks},
                               features=features).save_to_disk(str(path))
    (path / "eagle3_prepare.json").write_text(json.dumps({"tokenizer_fingerprint": fingerprint}))
    return path


@torch.no_grad()
def reference_states(model, input_ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """transformers' output_hidden_states [T, H] per index, and the last layer's output before the final norm."""
    seen = {}
    handle = model.model.layers[-1].register_forward_hook(lambda _m, _a, out: seen.update(pre=out))
    try:
        out = model(input_ids[None], output_hidden_states=True)
    finally:
        handle.remove()
    pre = seen["pre"][0] if isinstance(seen["pre"], tuple) else seen["pre"]
    return tuple(h[0] for h in out.hidden_states), pre[0]
