"""Checkpoint layouts: the exact standard key set, round trips, published shapes, speculators, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_hf import Eagle3DraftModel

from tests.helpers.drafters import DRAFT_VOCAB, HIDDEN, STANDARD_KEYS, VOCAB, packed_batch, tiny_model


def with_vocab(model):
    kept = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[kept] = True
    model.set_vocab_mapping(kept - torch.arange(DRAFT_VOCAB), t2d)
    return model


def logits_of(model):
    ids, aux, pos, doc = packed_batch([[6, 9]], 16, seed=3)
    with torch.no_grad():
        return model(ids, aux, pos, doc, ttt_steps=3).logits


def read(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_saved_keys_and_shapes_are_exactly_the_contract(tmp_path):
    model = with_vocab(tiny_model())
    model.save_pretrained(tmp_path)
    tensors = read(tmp_path)
    assert set(tensors) == STANDARD_KEYS  # no embed_tokens unless asked
    h, heads, kv, hd = HIDDEN, model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (heads * hd, 2 * h)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (kv * hd, 2 * h)
    assert tensors["fc.weight"].shape == (h, 3 * h)
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, h)
    assert tensors["d2t"].dtype == torch.int64 and tensors["d2t"].shape == (DRAFT_VOCAB,)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (VOCAB,)
    model.save_pretrained(tmp_path / "with_embed", include_embed_tokens=True)
    assert set(read(tmp_path / "with_embed")) == STANDARD_KEYS | {"embed_tokens.weight"}


def test_round_trip_gives_identical_logits(tmp_path):
    model = with_vocab(tiny_model())
    model.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    loaded.load_verifier_embeddings(model)  # the engines' behaviour: the verifier's embedding
    assert torch.equal(loaded.d2t, model.d2t) and torch.equal(loaded.t2d, model.t2d)
    for a, b in zip(logits_of(model), logits_of(loaded)):
        assert torch.equal(a, b)


def test_a_full_vocabulary_drafter_is_saved_without_a_mapping_and_passes_check(tmp_path):
    """vLLM refuses d2t when the draft vocabulary is the whole vocabulary; the export leaves both tensors out,
    and loading restores the identity mapping."""
    from eagle3_hf.publish.check import check_drafter

    config = tiny_model().config
    config.draft_vocab_size = VOCAB
    model = Eagle3DraftModel(config)
    model.save_pretrained(tmp_path)
    assert set(read(tmp_path)) == STANDARD_KEYS - {"d2t", "t2d"}
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    assert torch.equal(loaded.draft_to_target(torch.arange(VOCAB)), torch.arange(VOCAB))
    assert not [f for f in check_drafter(tmp_path) if f.level == "error"]


def test_published_standard_and_speculators_layouts_give_the_same_logits(tmp_path):
    model = with_vocab(tiny_model())
    state = {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    cfg = model.config
    # a standard-layout checkpoint as other tools publish it: kimi_k2 model_type, only eagle_config ids,
    # legacy rope keys, no embed_tokens
    published = tmp_path / "published"
    published.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(published / "model.safetensors"))
    (published / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "kimi_k2", "hidden_size": HIDDEN,
        "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "num_hidden_layers": 1,
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "hidden_act": "silu", "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                               "use_aux_hidden_state": True},
    }))
    standard = Eagle3DraftModel.from_pretrained(published, verifier=model)
    assert standard.config.aux_hidden_state_indices == [2, 4, 5]
    speculators_dir = model.save_speculators(tmp_path / "speculators")
    spec_config = json.loads((speculators_dir / "config.json").read_text())
    assert spec_config["speculators_model_type"] == "eagle3" and spec_config["architectures"] == ["Eagle3Speculator"]
    spec_keys = set(read(speculators_dir))
    assert "layers.0.self_attn.q_proj.weight" in spec_keys and "embed_tokens.weight" in spec_keys
    assert not any(k.startswith("midlayer.") for k in spec_keys)
    speculators = Eagle3DraftModel.from_pretrained(speculators_dir)
    assert speculators.embed_tokens_loaded and speculators.source_layout == "speculators"
    for a, b, c in zip(logits_of(model), logits_of(standard), logits_of(speculators)):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_refusals_name_the_problem(tmp_path):
    model = with_vocab(tiny_model())
    no_head = dict(model.state_dict())
    del no_head["lm_head.weight"]
    with pytest.raises(ValueError, match="lm_head"):
        model.save_pretrained(tmp_path / "a", state_dict=no_head)
    bad_map = dict(model.state_dict())
    bad_map["t2d"] = bad_map["t2d"].clone()
    bad_map["t2d"][torch.nonzero(~bad_map["t2d"])[0]] = True
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        model.save_pretrained(tmp_path / "b", state_dict=bad_map)
    as_indices = dict(model.state_dict())
    as_indices["d2t"] = as_indices["d2t"] + torch.arange(DRAFT_VOCAB) + 950  # absolute ids, not offsets
    with pytest.raises(ValueError, match="offsets"):
        model.save_pretrained(tmp_path / "c", state_dict=as_indices)
    wrong_shape = dict(model.state_dict())
    wrong_shape["fc.weight"] = torch.zeros(HIDDEN, 2 * HIDDEN)
    with pytest.raises(ValueError, match="fc.weight"):
        model.save_pretrained(tmp_path / "d", state_dict=wrong_shape)
    # loading: a checkpoint missing lm_head, and one with a name an engine would drop
    model.save_pretrained(tmp_path / "good")
    tensors = read(tmp_path / "good")
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "good" / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head"):
        Eagle3DraftModel.from_pretrained(tmp_path / "good")
    model.save_pretrained(tmp_path / "renamed")
    tensors = read(tmp_path / "renamed")
    tensors["model.norm.weight"] = tensors.pop("norm.weight")
    save_file(tensors, str(tmp_path / "renamed" / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight"):
        Eagle3DraftModel.from_pretrained(tmp_path / "renamed")
