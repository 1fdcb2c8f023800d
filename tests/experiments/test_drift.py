"""Drifted verifiers (a model's 'next version'): new weights, same shapes and tokenizer, cached per strength."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from eagle3_hf.data.fingerprint import tokenizer_fingerprint
from eagle3_hf.verifier.loading import load_verifier

from experiments.drift import DriftRecipe, build_drifted_verifiers, measure_drift, weight_change

RECIPE = DriftRecipe(lr=1e-2, warmup=1, seq_len=16, batch_size=2)
AUX = [2, 3, 4]


@pytest.fixture()
def blocks():
    return torch.randint(3, 2000, (6, 16), generator=torch.Generator().manual_seed(0))


def test_drifted_verifier_differs_but_keeps_shapes_and_tokenizer(tiny_verifier_dir, tmp_path, monkeypatch, blocks):
    monkeypatch.setenv("EAGLE3_HF_CACHE", str(tmp_path / "cache"))
    paths = build_drifted_verifiers(str(tiny_verifier_dir), [1, 3], RECIPE, blocks=blocks, log=lambda _: None)
    assert sorted(paths) == [1, 3] and len(set(paths.values())) == 2
    original = load_verifier(str(tiny_verifier_dir))
    shapes = {k: v.shape for k, v in original.state_dict().items()}
    fingerprint = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_verifier_dir))
    held_out = [blocks[0], blocks[1, :9]]
    same = measure_drift(original, original, held_out, AUX)
    assert same["greedy_agreement"] == 1.0 and abs(same["kl"]) < 1e-6 and same["aux_cosine_mean"] > 0.9999
    previous = 0.0
    for steps in (1, 3):
        drifted = load_verifier(str(paths[steps]))
        assert {k: v.shape for k, v in drifted.state_dict().items()} == shapes
        assert drifted.config.to_diff_dict() == original.config.to_diff_dict()
        assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(paths[steps])) == fingerprint
        change = weight_change(original, drifted)
        assert change > previous  # more steps, more drift
        previous = change
        d = measure_drift(original, drifted, held_out, AUX)
        assert d["tokens"] == 25 and d["kl"] > 0 and d["aux_cosine_mean"] < 0.9999
        assert set(d["aux_cosine"]) == {"2", "3", "4"}


def test_strength_is_cached_and_independent_of_the_trajectory(tiny_verifier_dir, tmp_path, monkeypatch, blocks):
    """The step-1 checkpoint of a 3-step trajectory is the step-1 verifier: a killed build re-runs only what is
    missing, and a cached strength is never retrained."""
    monkeypatch.setenv("EAGLE3_HF_CACHE", str(tmp_path / "a"))
    long_run = build_drifted_verifiers(str(tiny_verifier_dir), [1, 3], RECIPE, blocks=blocks, log=lambda _: None)

    def must_not_train(_line):
        raise AssertionError("a cached drift strength was retrained")

    assert build_drifted_verifiers(str(tiny_verifier_dir), [3, 1], RECIPE, blocks=blocks,
                                   log=must_not_train) == long_run
    monkeypatch.setenv("EAGLE3_HF_CACHE", str(tmp_path / "b"))
    short_run = build_drifted_verifiers(str(tiny_verifier_dir), [1], RECIPE, blocks=blocks, log=lambda _: None)
    assert short_run[1].name == long_run[1].name
    a, b = load_verifier(str(long_run[1])).state_dict(), load_verifier(str(short_run[1])).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list((tmp_path / "b").glob("*.tmp"))
