"""The DFlash drafter: training-time blocks equal decoding-time blocks (train = serve), training lowers the loss,
and the served layout round-trips with the same logits."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from eagle3_hf.model.configuration_dflash import DFlashConfig
from eagle3_hf.model.dflash_checkpoint import expected_dflash_shapes
from eagle3_hf.model.modeling_dflash import DFlashDraftModel
from eagle3_hf.train.dflash_loss import block_targets, dflash_loss, sample_anchors

VOCAB, HIDDEN, BLOCK = 97, 64, 5


def tiny_dflash(seed: int = 0, layers: int = 2, block_size: int = BLOCK) -> DFlashDraftModel:
    verifier = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2)
    config = DFlashConfig.from_verifier(verifier, mask_token_id=VOCAB - 1, num_hidden_layers=layers,
                                        block_size=block_size)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = DFlashDraftModel(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    # logits of scale ~2, so an fp32 tolerance of 1e-5 measures the math, not the rounding of large numbers
    model.load_verifier_weights(torch.randn(VOCAB, HIDDEN, generator=g), 0.2 * torch.randn(VOCAB, HIDDEN, generator=g))
    with torch.no_grad():  # non-trivial norms and larger weights, so a swapped norm or a lost key shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif p.requires_grad:
                p.mul_(4.0)
    return model


def packed(lengths_per_row: list[list[int]], length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths_per_row)
    doc = torch.full((rows, length), -1)
    pos = torch.zeros(rows, length, dtype=torch.long)
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for d, n in enumerate(lengths):
            doc[b, start:start + n], pos[b, start:start + n] = d, torch.arange(n)
            start += n
    loss_mask = (torch.rand(rows, length, generator=g) > 0.2).long() * (doc >= 0)
    return {"input_ids": torch.randint(0, VOCAB - 1, (rows, length), generator=g),
            "aux_hidden_states": torch.randn(rows, length, 3 * HIDDEN, generator=g),
            "last_hidden_state": torch.randn(rows, length, HIDDEN, generator=g),
            "verifier_greedy": torch.randint(0, VOCAB - 1, (rows, length), generator=g),
            "position_ids": pos, "document_ids": doc, "loss_mask": loss_mask}


def test_training_blocks_equal_decoding_blocks():
    """Blocks at several anchors of a packed batch (two documents per row, anchors near document starts and ends)
    give the logits `draft_block` gives after a context of that document's tokens before the anchor."""
    model = tiny_dflash()
    batch = packed([[9, 14], [23]], 24)
    anchors = torch.tensor([[1, 4, 10, 20], [3, 12, 21, -1]])  # row 0: doc 0 is 0..8, doc 1 is 9..22
    out = model(batch["input_ids"], batch["aux_hidden_states"], anchors, batch["position_ids"],
                batch["document_ids"])
    n = 0
    for b in range(2):
        for a in anchors[b].tolist():
            if a < 0:
                continue
            start = a - int(batch["position_ids"][b, a])
            context = model.extend_context(None, batch["aux_hidden_states"][b:b + 1, start:a],
                                           torch.arange(a - start)[None])
            served = model.draft_block(int(batch["input_ids"][b, a]), context)
            torch.testing.assert_close(out.logits[n], served, atol=1e-5, rtol=0)
            n += 1
    assert n == out.logits.shape[0] == 7


def test_context_grows_in_pieces_as_decoding_adds_it():
    """Context added a few tokens at a time (as decoding commits accepted tokens) equals it added at once."""
    model = tiny_dflash()
    aux = torch.randn(1, 11, 3 * HIDDEN, generator=torch.Generator().manual_seed(3))
    whole = model.extend_context(None, aux, torch.arange(11)[None])
    parts = None
    for lo, hi in ((0, 4), (4, 5), (5, 11)):
        parts = model.extend_context(parts, aux[:, lo:hi], torch.arange(lo, hi)[None])
    assert parts is not None
    torch.testing.assert_close(model.draft_block(7, parts, 2), model.draft_block(7, whole, 2), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="start at 3"):
        model.extend_context(parts, aux[:, :1], torch.tensor([[3]]))


def test_anchors_and_targets_stay_in_their_document():
    batch = packed([[6, 10], [15]], 16, seed=1)
    anchors = sample_anchors(batch, 50, torch.Generator().manual_seed(0))
    for b in range(2):
        for a in anchors[b].tolist():
            if a < 0:
                continue
            assert batch["position_ids"][b, a] >= 1 and batch["document_ids"][b, a + 1] == batch["document_ids"][b, a]
            assert batch["loss_mask"][b, a] == 1 and batch["loss_mask"][b, a + 1] == 1
    greedy, scored = block_targets(batch, anchors, BLOCK)
    valid = anchors[anchors >= 0]
    rows = (anchors >= 0).nonzero()
    for n, (b, j) in enumerate(rows.tolist()):
        a = int(anchors[b, j])
        for k in range(1, BLOCK):
            t = a + k
            expect = (t < 16 and batch["document_ids"][b, t] == batch["document_ids"][b, a]
                      and bool(batch["loss_mask"][b, t]))
            assert bool(scored[n, k - 1]) == expect, (a, k)
            if expect:
                assert greedy[n, k - 1] == batch["verifier_greedy"][b, t - 1]
    assert scored.shape == (valid.numel(), BLOCK - 1) and bool(scored[:, 0].all())


def test_two_steps_lower_the_loss_and_save_reload_keeps_logits(tmp_path):
    model = tiny_dflash(layers=1).train()
    batch = packed([[12, 12]], 24, seed=2)
    batch["dflash_anchors"] = sample_anchors(batch, 8, torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(3):
        step = dflash_loss(model, batch)
        loss = step.normalised()
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[2] < losses[1] < losses[0]
    assert step.counts is not None and step.counts.shape == (8, BLOCK - 1)

    model.eval()
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    # HF indices (2, 4, 5) are written as layer outputs (each - 1), the block size where llama.cpp reads it first
    assert raw["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 3, 4], "block_size": BLOCK}
    assert "use_sliding_window" not in raw and "eagle_aux_hidden_state_layer_ids" not in raw and raw["head_dim"] == 16
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == BLOCK and raw["rope_theta"] == 10000.0 and "eagle_config" not in raw
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert names == expected_dflash_shapes(model.config)
    assert "lm_head.weight" not in names and "embed_tokens.weight" not in names

    reloaded = DFlashDraftModel.from_pretrained(tmp_path)
    reloaded.load_verifier_weights(model.embed_tokens.weight, model.lm_head.weight)
    assert reloaded.config.aux_hidden_state_indices == [2, 4, 5] and reloaded.config.block_size == BLOCK
    anchors = batch["dflash_anchors"]
    with torch.no_grad():
        a = model(batch["input_ids"], batch["aux_hidden_states"], anchors, batch["position_ids"],
                  batch["document_ids"]).logits
        b = reloaded(batch["input_ids"], batch["aux_hidden_states"], anchors, batch["position_ids"],
                     batch["document_ids"]).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_eagle3_reader_names_a_dflash_checkpoint(tmp_path):
    from eagle3_hf import Eagle3DraftModel

    tiny_dflash(layers=1).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="is a DFlash drafter, not an EAGLE-3 one"):
        Eagle3DraftModel.from_pretrained(tmp_path)


def test_a_misnamed_weight_is_refused(tmp_path):
    model = tiny_dflash(layers=1)
    state = model.state_dict()
    state["layers.0.self_attn.qkv_proj.weight"] = state.pop("layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="qkv_proj"):
        model.save_pretrained(tmp_path, state_dict=state)


def test_the_loss_is_the_decayed_soft_cross_entropy_over_scored_positions():
    """Σ_k exp(-(k - 1) / decay) Σ_anchors CE(teacher, draft) over scored positions, / anchors: recomputed here with
    plain autograd ops, gradients included."""
    model = tiny_dflash(layers=1).train()
    batch = packed([[10, 13]], 23, seed=4)
    batch["dflash_anchors"] = sample_anchors(batch, 6, torch.Generator().manual_seed(1))
    step = dflash_loss(model, batch)
    loss = step.normalised()
    (grad,) = torch.autograd.grad(loss, model.fc.weight)

    out = model(batch["input_ids"], batch["aux_hidden_states"], batch["dflash_anchors"], batch["position_ids"],
                batch["document_ids"], batch["last_hidden_state"])
    _, scored = block_targets(batch, batch["dflash_anchors"], BLOCK)
    ce = -(out.teacher_probs * torch.log_softmax(out.logits, -1)).sum(-1) * scored  # [N, B - 1]
    weights = torch.exp(-torch.arange(BLOCK - 1.0) / model.config.block_loss_decay)
    expected = (ce.sum(0) * weights).sum() / (batch["dflash_anchors"] >= 0).sum()
    (expected_grad,) = torch.autograd.grad(expected, model.fc.weight)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-4)
    assert bool((~scored).any()) and bool(scored.any())  # both kinds of position are in the batch
