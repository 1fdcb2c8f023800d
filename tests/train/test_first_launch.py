"""The first training launch on a feature directory: shards as their writer left them are not read again, a copied
directory is hashed once, and every refusal that needs no shard bytes comes before any hashing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import eagle3_hf.features.verify as verify
from eagle3_hf.data.vocab import load_vocab, save_vocab
from eagle3_hf.features.store import load_manifest
from eagle3_hf.features.verify import STAMP
from eagle3_hf.scripts.train import main as train_main

from tests.helpers.data import COMMON, FINGERPRINT, SYN_VOCAB, HashSpy

ONE_STEP = ["--max-steps", "1", "--save-strategy", "no", "--eval-strategy", "no", "--validation-fraction", "0.2",
            "--report-to", "none", *COMMON]


@pytest.fixture
def spy(monkeypatch) -> HashSpy:
    found = HashSpy()
    monkeypatch.setattr(verify, "sha256_file", found)
    return found


def launch(synthetic, features: Path, out: Path, *extra: str) -> dict:
    return train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", str(features), "--output-dir",
                       str(out), *ONE_STEP, *extra])


def test_freshly_extracted_shards_are_not_hashed_again(synthetic, tmp_path, spy):
    features = synthetic["features"]
    assert all("written" in s for s in load_manifest(features)["shards"])
    summary = launch(synthetic, features, tmp_path / "run")
    assert summary["log_history"] and spy.files == [] and not (features / STAMP).exists()
    assert summary["data"]["shards_hashed_at_start"] == 0  # what the run records


def test_a_copied_directory_is_hashed_once_after_the_cheap_refusals(synthetic, tmp_path, spy):
    copy = Path(shutil.copytree(synthetic["features"], tmp_path / "copy"))  # mtimes kept, new inodes
    shards = sorted(s["file"] for s in load_manifest(copy)["shards"])
    d2t, t2d, _ = load_vocab(copy / "vocab.safetensors", FINGERPRINT, SYN_VOCAB)
    foreign = save_vocab(tmp_path / "foreign.safetensors", d2t, t2d, "another-tokenizer", coverage=1.0)
    with pytest.raises(ValueError, match="another-tokenizer"):
        launch(synthetic, copy, tmp_path / "refused", "--vocab", str(foreign))
    assert spy.files == []  # refused before a single shard was read
    first = launch(synthetic, copy, tmp_path / "first")
    assert sorted(spy.files) == shards and first["data"]["shards_hashed_at_start"] == len(shards)
    assert sorted(json.loads((copy / STAMP).read_text())["shards"]) == shards
    second = launch(synthetic, copy, tmp_path / "second")
    assert sorted(spy.files) == shards and second["data"]["shards_hashed_at_start"] == 0  # the relaunch: nothing
    launch(synthetic, copy, tmp_path / "always", "--verify-features", "always", "--verify-threads", "2")
    assert sorted(spy.files) == sorted(shards * 2)
