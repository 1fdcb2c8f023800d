"""diff-features: identical extractions agree exactly; bf16 vs fp8 and a perturbed verifier show up per layer."""

from __future__ import annotations

import json
import shutil

import datasets
import pytest
import torch

from eagle3_hf.data.fingerprint import tokenizer_fingerprint
from eagle3_hf.evaluation.feature_diff import diff_features, format_report
from eagle3_hf.features.routes.transformers import extract_features

from tests.helpers.data import make_prepared
from tests.helpers.verifiers import make_tiny_verifier


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer):
    fp = tokenizer_fingerprint(tokenizer)
    root = tmp_path_factory.mktemp("diff")
    prep = make_prepared(root / "prep", fp, n=6, hi=30, vocab=2048)
    small = root / "prep_small"  # the first 4 samples: same ids, same tokens
    datasets.load_from_disk(str(prep)).select(range(4)).save_to_disk(str(small))
    shutil.copy(prep / "eagle3_prepare.json", small / "eagle3_prepare.json")
    model = make_tiny_verifier(vocab_size=2048, hidden_size=32, num_layers=6)
    for name, dtype, data in (("bf16", "bf16", prep), ("bf16_again", "bf16", small), ("fp8", "fp8", prep)):
        extract_features(model, fp, data, root / name, dtype=dtype, progress=False)
    noisy = make_tiny_verifier(vocab_size=2048, hidden_size=32, num_layers=6)
    with torch.no_grad():  # a "different engine": layer 4 (whose output is index 5) perturbed
        noisy.model.layers[4].mlp.down_proj.weight.mul_(1.5)
    extract_features(noisy, fp, prep, root / "noisy", progress=False)
    return root


def test_identical_extractions(dirs):
    r = diff_features(dirs / "bf16", dirs / "bf16_again")
    assert r["samples_compared"] == 4 and r["only_in_a"] == 2 and r["only_in_b"] == 0
    assert r["greedy_agreement"] == 1.0 and not r["warnings"]
    for stats in r["layers"].values():
        assert stats["cos_p5"] == pytest.approx(1.0) and stats["rel_err_max"] == 0.0


def test_fp8_vs_bf16_and_perturbed_layer(dirs, tmp_path):
    r = diff_features(dirs / "bf16", dirs / "fp8")
    assert any("dtype differs" in w for w in r["warnings"])
    assert set(r["layers"]) == {"aux[2]", "aux[4]", "aux[5]", "last"}
    for stats in r["layers"].values():
        assert 0.99 < stats["cos_mean"] < 1.0 and 0 < stats["rel_err_mean"] < 0.06
    assert r["greedy_agreement"] == 1.0  # greedy is computed before storage: quantisation never touches it
    p = diff_features(dirs / "bf16", dirs / "noisy")
    assert p["layers"]["aux[2]"]["rel_err_max"] == 0.0 and p["layers"]["aux[4]"]["rel_err_max"] == 0.0
    assert p["layers"]["aux[5]"]["rel_err_mean"] > 0.01  # only layers after the change move
    assert p["layers"]["last"]["cos_mean"] < 1.0
    text = format_report(p)
    assert "aux[5]" in text and "greedy agreement" in text
    json.dumps(p)  # the report is JSON-serialisable


def test_cli(dirs, tmp_path, capsys):
    from eagle3_hf.cli import main

    out = tmp_path / "r.json"
    assert main(["diff-features", str(dirs / "bf16"), str(dirs / "fp8"), "--json", str(out)]) == 0
    assert "cos mean" in capsys.readouterr().out
    assert json.loads(out.read_text())["samples_compared"] == 6
