"""gpu_check's extraction + speculative decoding: a tiny learnable verifier on the device, its features written
with the project's shard writer (bf16), a tiny drafter trained on them, then speculative decoding checked token for
token against the verifier's own greedy decoding (lossless)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from eagle3_hf import Eagle3Config, Eagle3DraftModel

from .train_step import make_train_step


def learnable_verifier(device: str, vocab: int = 256, hidden: int = 64, layers: int = 6):
    """A tiny Llama whose greedy next token is mostly (token + 1): a drafter learns it in a few hundred steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.copy_(torch.roll(model.model.embed_tokens.weight, shifts=1, dims=0))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
    return model.to(device).eval().requires_grad_(False)


def extraction_and_speculative(device: str, out_dir: Path, train_steps: int) -> dict:
    from eagle3_hf.data.vocab import vocab_from_target_ids
    from eagle3_hf.decoding import compare_to_greedy, greedy_generate, speculative_decode
    from eagle3_hf.features.packing import PackedCollator, PackedDataset
    from eagle3_hf.features.reader import FeatureDataset
    from eagle3_hf.features.records import make_header
    from eagle3_hf.features.routes.transformers import verifier_info
    from eagle3_hf.features.shard_writer import ShardWriter
    from eagle3_hf.features.store import merge_manifests
    from eagle3_hf.verifier.capture import capture_features

    verifier = learnable_verifier(device)
    aux = [1, 3, 4]
    g = torch.Generator().manual_seed(1)
    samples = [torch.arange(2, 200, 2)[torch.randint(0, 99, (int(torch.randint(24, 64, (1,), generator=g)),),
                                                      generator=g)] for _ in range(48)]
    t0 = time.perf_counter()
    writer = ShardWriter(out_dir, make_header(verifier_info(verifier, "tiny-learnable"), "tiny", aux, "bfloat16"))
    tokens = 0
    for i, ids in enumerate(samples):
        feats = capture_features(verifier, ids, aux, out_device="cpu")
        mask = torch.ones_like(ids)
        mask[:4] = 0
        writer.add(f"s{i:03d}", ids, mask, feats["aux_hidden_states"], feats["last_hidden_state"],
                   feats["verifier_greedy"])
        tokens += ids.numel()
    writer.close()
    merge_manifests(out_dir)
    extract_s = time.perf_counter() - t0

    features = FeatureDataset(out_dir, split="all")
    greedy = torch.cat([features[i]["verifier_greedy"] for i in range(len(features))])
    d2t, t2d = vocab_from_target_ids(torch.unique(greedy), verifier.config.vocab_size)
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=d2t.numel(), aux_hidden_state_indices=aux)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    drafter = Eagle3DraftModel(config)
    drafter.set_vocab_mapping(d2t, t2d)
    drafter.load_verifier_embeddings(verifier.cpu())
    drafter.attach_teacher(verifier)
    verifier.to(device)
    drafter.to(device).train()
    step = make_train_step(drafter, device, bf16=False, lr=3e-3)
    packed = PackedDataset(features, 256, seed=None)
    collate = PackedCollator(max_seq_len=256)
    rows = [{k: v.to(device) for k, v in collate([packed[r]]).items()} for r in range(len(packed))]
    t0 = time.perf_counter()
    losses = [step(rows[s % len(rows)]) for s in range(train_steps)]
    train_s = time.perf_counter() - t0
    drafter.eval()

    results, accepted, forwards = [], 0, 0
    for p in range(4):
        prompt = samples[p][:8].tolist()
        ref = greedy_generate(verifier, prompt, max_new_tokens=32)
        spec = speculative_decode(verifier, drafter, prompt, steps=3, max_new_tokens=32)
        verdict, where = compare_to_greedy(spec.tokens, spec.margins, ref.tokens, ref.margins)
        results.append(verdict)
        accepted += len(spec.tokens)
        forwards += spec.num_verifier_forwards + 1
    return {"samples": len(samples), "tokens": tokens, "extract_s": extract_s, "feature_dtype": "bfloat16",
            "drafter_train_steps": train_steps, "train_s": train_s, "first_loss": losses[0], "last_loss": losses[-1],
            "lossless": results, "lossless_ok": all(r != "mismatch" for r in results),
            "tokens_per_verifier_forward": accepted / max(forwards, 1)}
