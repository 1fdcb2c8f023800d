"""The drafter: config contract, the TTT unroll on packed rows, and agreement with engine-style inference."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.model.ttt_attention import _causal_with_diagonals, shift_within_documents
from eagle3_hf.verifier.family import aux_indices_from_config, engine_aux_layer_ids

from tests.helpers.drafters import (
    DRAFT_VOCAB,
    HIDDEN,
    VOCAB,
    packed_batch,
    reference_unroll,
    tiny_config,
    tiny_model,
)


def test_config_writes_aux_ids_where_each_engine_reads_them(tmp_path):
    config = tiny_config(aux_hidden_state_indices=[2, 4, 5])
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama" and saved["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved["num_hidden_layers"] == 1 and saved["tie_word_embeddings"] is False
    assert saved["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: output_hidden_states index
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang adds 1
    assert saved["eagle_config"]["use_aux_hidden_state"] is True
    assert saved["rope_theta"] == 10000.0 and "rope_scaling" in saved  # legacy keys for older loaders
    assert saved["draft_vocab_size"] == DRAFT_VOCAB and saved["vocab_size"] == VOCAB
    assert saved["norm_before_residual"] is False
    assert Eagle3Config.from_pretrained(tmp_path).aux_hidden_state_indices == [2, 4, 5]
    # a published config carrying only SGLang's ids recovers the same training indices
    assert aux_indices_from_config({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}) == [2, 30, 58]
    assert engine_aux_layer_ids([2, 30, 58]) == {"vllm": [2, 30, 58], "sglang": [1, 29, 57]}
    with pytest.raises(ValueError, match="embedding"):
        engine_aux_layer_ids([0, 3, 5])


def test_from_verifier_kimi_k25_nested_text_config():
    kimi_text = dict(model_type="kimi_k2", hidden_size=7168, num_hidden_layers=61, vocab_size=163840,
                     intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536,
                     kv_lora_rank=512, qk_rope_head_dim=64, rope_theta=50000.0, max_position_embeddings=262144,
                     rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    config = Eagle3Config.from_verifier({"model_type": "kimi_k25", "text_config": kimi_text}, draft_vocab_size=32000)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        7168, 56, 8, 128)
    assert config.vocab_size == 163840 and config.aux_hidden_state_indices == [2, 30, 58]
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["rope_theta"] == 50000.0
    assert config.max_position_embeddings == 262144
    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    small = Eagle3Config.from_verifier(smol, draft_vocab_size=8192)
    assert (small.num_attention_heads, small.num_key_value_heads, small.head_dim) == (9, 3, 64)
    assert small.aux_hidden_state_indices == [2, 15, 27]
    with pytest.raises(ValueError, match="outside 1..29"):
        Eagle3Config.from_verifier(smol, aux_hidden_state_indices=[0, 15, 30])


def test_teacher_softcap_comes_from_the_text_config():
    """A verifier that nests its language model (Gemma 3, Kimi-K2.5) keeps final_logit_softcapping in
    text_config; the teacher must apply the same soft-cap as the greedy targets (capture reads the text config)."""
    from transformers import Gemma3Config

    nested = Gemma3Config(text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                           final_logit_softcapping=30.0))

    class NestedVerifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = nested
            self.head = torch.nn.Linear(16, 64, bias=False)

        def get_output_embeddings(self):
            return self.head

    config = Eagle3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, draft_vocab_size=8, aux_hidden_state_indices=[1, 2, 3])
    model = Eagle3DraftModel(config)
    model.attach_teacher(NestedVerifier())
    assert model.teacher_logit_softcap == 30.0


def test_shift_never_crosses_documents():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    x = torch.tensor([[10, 11, 12, 20, 21, 0]])
    out, valid = shift_within_documents(x, doc, 1)
    assert out.tolist() == [[11, 12, 0, 21, 0, 0]] and valid.tolist() == [[True, True, False, True, False, False]]
    out, valid = shift_within_documents(x, doc, 2)
    assert out.tolist() == [[12, 0, 0, 0, 0, 0]]


def test_mask_is_causal_block_plus_diagonals():
    mask = _causal_with_diagonals(3, 3, torch.float32, "cpu") == 0
    expected = torch.tensor([
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("packed", ["row", "document"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_unroll_equals_per_document_brute_force(attn, packed):
    model = tiny_model()
    model.config._attn_implementation = attn
    model.packed_attention = packed
    rows = [[7, 9, 4], [12, 1, 3]]
    ids, aux, pos, doc = packed_batch(rows, 22)
    steps = 4
    out = model(ids, aux, pos, doc, ttt_steps=steps)
    checked = 0
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            ref = reference_unroll(model, ids[b, start:start + n], aux[b, start:start + n], steps)
            for i in range(steps):
                valid = out.step_valid[i][b, start:start + n]
                assert valid.sum() == max(n - 1 - i, 0)  # the last i+1 positions of a document drop out
                got = out.logits[i][b, start:start + n][valid]
                want = ref[i][valid]
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
                checked += int(valid.sum())
            start += n
    assert checked > 40


@pytest.mark.parametrize("packed", ["row", "document"])
def test_no_leakage_between_packed_documents(packed):
    model = tiny_model()
    model.packed_attention = packed
    ids, aux, pos, doc = packed_batch([[6, 8]], 14)
    base = model(ids, aux, pos, doc, ttt_steps=3)
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[0, :6] = (ids2[0, :6] + 1) % VOCAB  # change only the first document
    aux2[0, :6] += 1.0
    changed = model(ids2, aux2, pos, doc, ttt_steps=3)
    for i in range(3):
        second = doc[0] == 1
        torch.testing.assert_close(base.logits[i][0, second], changed.logits[i][0, second])
        assert not torch.allclose(base.logits[i][0, ~second], changed.logits[i][0, ~second])


def test_a_misspelt_forward_argument_is_an_error_not_ignored():
    """`ttt_step=5` (for ttt_steps) once ran silently with the default unroll."""
    model = tiny_model()
    ids, aux, pos, doc = packed_batch([[6, 8]], 14)
    with pytest.raises(TypeError, match="ttt_step"):
        model(ids, aux, pos, doc, ttt_step=5)


def test_missing_embeddings_are_an_error_not_a_random_layer(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path)
    ids, aux, pos, doc = packed_batch([[5]], 5)
    with pytest.raises(RuntimeError, match="embed_tokens"):
        loaded(ids, aux, pos, doc)


@pytest.mark.parametrize("tied", [False, True])
def test_init_lm_head_from_verifier_copies_its_draft_rows_in_d2t_order(tied):
    """--init-lm-head verifier: row j = the verifier's lm_head row of target id j + d2t[j] (its embedding row
    when it ties them), exactly."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    verifier = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
                                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=tied))
    model = tiny_model()
    kept = torch.randperm(VOCAB)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[kept] = True
    model.set_vocab_mapping(kept - torch.arange(DRAFT_VOCAB), t2d)
    model.attach_teacher(verifier)
    before = model.lm_head.weight.clone()
    model.init_lm_head_from_verifier()
    source = verifier.model.embed_tokens.weight if tied else verifier.lm_head.weight
    assert torch.equal(model.lm_head.weight, source[kept])
    assert not torch.equal(before, model.lm_head.weight)
