"""capture_features must return exactly what transformers' output_hidden_states would, with hooks only."""

from __future__ import annotations

import pytest
import torch

from eagle3_hf.verifier.capture import capture_features
from eagle3_hf.verifier.family import check_aux_indices, default_aux_indices

from tests.helpers.verifiers import make_tiny_verifier


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_verifier(vocab_size=1000, num_layers=8)


def _reference(model, ids, indices):
    out = model(ids[None], output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[i][0] for i in indices], -1), hs[-1][0], out.logits[0].argmax(-1)


def test_default_aux_indices():
    assert default_aux_indices(30) == [2, 15, 27]
    assert default_aux_indices(61) == [2, 30, 58]
    assert default_aux_indices(8) == [2, 4, 5]
    assert default_aux_indices(6) == [2, 4, 5] and default_aux_indices(5) == [2, 3, 4]  # tiny: not index 1
    assert default_aux_indices(4) == [1, 2, 3]  # only there: three distinct layers need index 1
    with pytest.raises(ValueError, match="1..29"):
        check_aux_indices((0, 5, 9), 30)
    with pytest.raises(ValueError, match="post-norm"):
        check_aux_indices((2, 15, 30), 30)
    with pytest.raises(ValueError, match="distinct"):
        check_aux_indices((2, 2, 5), 30)


def test_capture_equals_output_hidden_states(tiny):
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (29,))
    for indices in [(2, 4, 5), (1, 3, 7), (7, 1, 4)]:
        f = capture_features(tiny, ids, indices)
        aux, last, greedy = _reference(tiny, ids, indices)
        assert f["aux_hidden_states"].shape == (29, 3 * 64)
        assert torch.equal(f["aux_hidden_states"], aux)
        assert torch.equal(f["last_hidden_state"], last)  # HF hidden_states[-1] is post-norm
        assert torch.equal(f["verifier_greedy"], greedy)
    # [1, T] input, and no hook is left behind (transformers keeps its own capture hooks)
    before = [len(layer._forward_hooks) for layer in tiny.model.layers]
    f2 = capture_features(tiny, ids[None], (2, 4, 5))
    assert torch.equal(f2["aux_hidden_states"], capture_features(tiny, ids, (2, 4, 5))["aux_hidden_states"])
    assert [len(layer._forward_hooks) for layer in tiny.model.layers] == before


def test_last_state_is_post_norm(tiny):
    ids = torch.randint(0, 1000, (11,))
    captured = {}
    h = tiny.model.layers[-1].register_forward_hook(lambda m, a, o: captured.update(pre=o))
    f = capture_features(tiny, ids, (2, 4, 5))
    h.remove()
    assert torch.allclose(f["last_hidden_state"], tiny.model.norm(captured["pre"])[0])
    assert not torch.allclose(f["last_hidden_state"], captured["pre"][0])


def test_greedy_chunked_and_softcap(tiny, monkeypatch):
    ids = torch.randint(0, 1000, (23,))
    _, _, greedy = _reference(tiny, ids, (2, 4, 5))
    from eagle3_hf.verifier import greedy as greedy_module

    monkeypatch.setattr(greedy_module, "MAX_TOKENS_PER_CHUNK", 4)  # 4 positions per chunk
    monkeypatch.setattr(greedy_module, "MIN_VOCAB_PER_CHUNK", 96)  # and 11 vocabulary chunks
    monkeypatch.setattr(greedy_module, "LOGIT_ELEMENTS_PER_CHUNK", 4 * 96)
    assert torch.equal(capture_features(tiny, ids, (2, 4, 5))["verifier_greedy"], greedy)
    monkeypatch.setattr(tiny.config, "final_logit_softcapping", 0.5, raising=False)
    assert torch.equal(capture_features(tiny, ids, (2, 4, 5))["verifier_greedy"], greedy)


def test_real_default_verifier(default_verifier_dir):
    from eagle3_hf.verifier.loading import load_verifier

    model = load_verifier(str(default_verifier_dir))
    assert model.config.num_hidden_layers == 30
    ids = torch.arange(100, 140)
    indices = default_aux_indices(30)
    f = capture_features(model, ids, indices)
    aux, last, greedy = _reference(model, ids, indices)
    assert torch.equal(f["aux_hidden_states"], aux)
    assert torch.equal(f["last_hidden_state"], last)
    assert torch.equal(f["verifier_greedy"], greedy)
