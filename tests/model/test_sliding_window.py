"""A sliding-window drafter (`sliding_window` N, `--drafter-window N`): the TTT unroll (both packed paths, every
attention implementation) computes exactly what an engine's windowed drafter computes step by step with a KV
cache; the window changes the drafter only where it binds; the config is written where speculators and vLLM
put it and read back only where vLLM would apply it; `check` says which engines serve it."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.model.checkpoint import config_from_published
from eagle3_hf.model.ttt_attention import PackedRowKeys, document_block_mask, document_mask

from tests.helpers.drafters import packed_batch, reference_unroll, tiny_model

DOCS = [8, 6]


def unroll_against_reference(model, steps=3):
    ids, aux, pos, doc = packed_batch([DOCS], 16)
    out = model(ids, aux, pos, doc, ttt_steps=steps)
    start, checked = 0, 0
    for n in DOCS:
        ref = reference_unroll(model, ids[0, start:start + n], aux[0, start:start + n], steps)
        for i in range(steps):
            valid = out.step_valid[i][0, start:start + n]
            torch.testing.assert_close(out.logits[i][0, start:start + n][valid], ref[i][valid], atol=2e-5, rtol=1e-4)
            checked += int(valid.sum())
        start += n
    assert checked > 20
    return out


@pytest.mark.parametrize("window", [4, 5])
@pytest.mark.parametrize("packed", ["row", "document"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_windowed_unroll_equals_windowed_incremental_drafting(window, packed, attn):
    """Training's window is decoding's: step i at token t (position t + i) sees context keys t + i - N < j <= t."""
    model = tiny_model(sliding_window=window)
    model.config._attn_implementation = attn
    model.packed_attention = packed
    unroll_against_reference(model)


def test_the_window_changes_the_drafter_only_where_it_binds():
    full = tiny_model()
    ids, aux, pos, doc = packed_batch([DOCS], 16)
    want = full(ids, aux, pos, doc, ttt_steps=3).logits
    wide = tiny_model(sliding_window=max(DOCS) + 3)  # every document fits: the same function
    for a, b in zip(wide(ids, aux, pos, doc, ttt_steps=3).logits, want):
        torch.testing.assert_close(a, b)
    narrow = tiny_model(sliding_window=4).eval()
    got = narrow(ids, aux, pos, doc, ttt_steps=3).logits
    assert torch.allclose(got[0][0, :4], want[0][0, :4], atol=1e-6)  # the first 4 tokens see all they would
    assert not torch.allclose(got[0][0, 4:8], want[0][0, 4:8], atol=1e-4)  # later ones do not


def test_flex_block_mask_allows_what_the_dense_mask_allows():
    """flex_attention's mask_mod (its BlockMask) and the sdpa/eager mask are one rule, window included."""
    doc = torch.tensor([[0] * 7 + [1] * 5 + [-1] * 4, [2] * 16])
    for diagonals in range(3):
        window = 5 - diagonals
        dense = document_mask(doc, diagonals, window)[:, 0]  # [B, L, diagonals + L]
        block = document_block_mask(doc, diagonals, window)
        b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(16), torch.arange(16 + diagonals), indexing="ij")
        assert torch.equal(block.mask_mod(b, torch.zeros_like(b), q, kv), dense)
        # row 0, token 6 of document 0: the last `window` keys of its document, itself included
        assert dense[0, 6, diagonals:].nonzero().flatten().tolist() == list(range(7 - window, 7))
    assert PackedRowKeys(doc, 3, window=5).mask("sdpa", 2, torch.float32).shape == (2, 1, 16, 18)


def test_a_window_below_the_ttt_steps_is_refused():
    with pytest.raises(ValueError, match="must exceed ttt_steps"):
        tiny_model(sliding_window=3)


def test_config_is_written_where_speculators_and_vllm_read_it(tmp_path):
    model = tiny_model(sliding_window=6)
    model.save_pretrained(tmp_path / "standard")
    raw = json.loads((tmp_path / "standard" / "config.json").read_text())
    assert (raw["sliding_window"], raw["layer_types"], raw["use_sliding_window"]) == (6, ["sliding_attention"], True)
    assert Eagle3DraftModel.from_pretrained(tmp_path / "standard").config.sliding_window == 6
    model.save_speculators(tmp_path / "speculators", verifier=torch.randn(model.config.vocab_size,
                                                                          model.config.hidden_size))
    spec = json.loads((tmp_path / "speculators" / "config.json").read_text())
    layer = spec["transformer_layer_config"]
    assert (layer["sliding_window"], layer["layer_types"], layer["use_sliding_window"]) == (
        6, ["sliding_attention"], True)
    assert Eagle3DraftModel.from_pretrained(tmp_path / "speculators").config.sliding_window == 6
    tiny_model().save_pretrained(tmp_path / "full")
    assert "sliding_window" not in json.loads((tmp_path / "full" / "config.json").read_text())


def test_published_configs_get_a_window_only_where_vllm_applies_one():
    raw = {k: v for k, v in tiny_model(sliding_window=6).config.to_dict().items()}
    tensors = tiny_model().state_dict()
    assert config_from_published(raw, tensors).sliding_window == 6
    assert config_from_published({**raw, "layer_types": ["full_attention"]}, tensors).sliding_window is None
    no_types = {k: v for k, v in raw.items() if k != "layer_types"}
    assert config_from_published(no_types, tensors).sliding_window is None
    assert Eagle3Config(**{**raw, "layer_types": ["full_attention"]}).sliding_window is None


def test_the_train_flag_reaches_the_drafter_and_a_finetune_keeps_or_changes_the_window(tmp_path, caplog):
    from transformers import HfArgumentParser, LlamaConfig

    from eagle3_hf.train.arguments import ModelArguments
    from eagle3_hf.train.setup import build_drafter

    from tests.helpers.drafters import AUX, HIDDEN

    verifier = LlamaConfig(vocab_size=1000, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2)
    d2t, t2d = torch.zeros(1000, dtype=torch.long), torch.ones(1000, dtype=torch.bool)

    def build(*flags):
        (args,) = HfArgumentParser(ModelArguments).parse_args_into_dataclasses(list(flags))
        return build_drafter(args, verifier, d2t, t2d, AUX, None)[0]

    windowed = build("--drafter-window", "64")
    assert windowed.config.sliding_window == 64 and build().config.sliding_window is None
    windowed.save_pretrained(tmp_path / "source")
    assert build("--finetune-from", str(tmp_path / "source")).config.sliding_window == 64  # kept, never dropped
    with caplog.at_level("WARNING", logger="eagle3_hf.train"):
        changed = build("--finetune-from", str(tmp_path / "source"), "--drafter-window", "128")
    assert changed.config.sliding_window == 128 and "attention window 64 -> 128" in caplog.text


def test_check_refuses_a_window_for_sglang_and_names_what_vllm_reads(tmp_path):
    from eagle3_hf.publish.check import check_drafter

    from tests.helpers.drafters import write_drafter

    path = write_drafter(tmp_path / "d", sliding_window=64, layer_types=["sliding_attention"], use_sliding_window=True)
    by_engine = {engine: {(f.level, f.code) for f in check_drafter(str(path), engine=engine)}
                 for engine in ("sglang", "vllm")}
    assert ("error", "window-unserved") in by_engine["sglang"]
    assert ("info", "window-versions") in by_engine["vllm"]
    assert not {code for _, code in by_engine["vllm"] if code.startswith("window")} - {"window-versions"}
    raw = json.loads((path / "config.json").read_text())
    del raw["layer_types"]
    (path / "config.json").write_text(json.dumps(raw))
    codes = {(f.level, f.code) for f in check_drafter(str(path), engine="vllm")}
    assert ("warning", "window-without-layer-types") in codes


@pytest.mark.parametrize("topk", [1, 3])
def test_decoding_a_windowed_drafter_past_its_window_stays_lossless(topk):
    """Chain and tree drafting with the window binding (a 40-token prompt, window 8): the output is the verifier's
    greedy output, and the drafter's proposals differ from the same weights with full attention."""
    from eagle3_hf.decoding import speculative_decode

    from tests.helpers.assertions import assert_matches_greedy
    from tests.helpers.drafters import random_drafter
    from tests.helpers.verifiers import lively_verifier

    verifier = lively_verifier()
    drafter = random_drafter(verifier)
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    results = {}
    for window in (None, 8):
        drafter.config.sliding_window = window
        spec = speculative_decode(verifier, drafter, prompt, steps=3, topk=topk, max_new_tokens=16)
        results[window] = assert_matches_greedy(verifier, prompt, 16, spec)
    with torch.no_grad():  # the window reaches the drafter's decode path: its step-0 logits change
        ids = torch.tensor([prompt[1:]])
        aux = torch.randn(1, len(prompt) - 1, 3 * verifier.config.hidden_size)
        positions = torch.arange(len(prompt) - 1)[None]
        windowed = drafter.draft_step(ids, aux, positions)[0]
        drafter.config.sliding_window = None
        full = drafter.draft_step(ids, aux, positions)[0]
    torch.testing.assert_close(windowed[:, :8], full[:, :8])
    assert not torch.allclose(windowed[:, 8:], full[:, 8:])
