"""One length from prepare to training: samples longer than the rows trained on are said at the start of training
(their tails were extracted and stored, never trained on), and the routes the README and the guide print bound
the samples at the length their recipe trains."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import yaml

from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.scripts.train import main as train_main
from eagle3_hf.train.training_data import untrained_tails

from tests.helpers.data import COMMON

ROOT = Path(__file__).resolve().parents[2]


def test_samples_longer_than_the_rows_are_said_once_with_what_is_lost(synthetic, tmp_path, caplog):
    longest = max(FeatureDataset(synthetic["features"], "train", 0.2, verify="none").lengths)
    assert longest > 24
    with caplog.at_level(logging.WARNING, logger="eagle3_hf.train"):
        train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
                    "--output-dir", str(tmp_path / "run"), "--max-steps", "1", "--save-strategy", "no",
                    "--eval-strategy", "no", "--validation-fraction", "0.2", "--report-to", "none", *COMMON,
                    "--max-seq-len", "24"])
    said = [r.getMessage() for r in caplog.records if "longer than --max-seq-len 24" in r.getMessage()]
    assert len(said) == 1 and "were extracted but are not trained on" in said[0], said
    assert f"the longest has {longest} tokens" in said[0] and f"--max-seq-len {longest})" in said[0]


def test_nothing_is_said_when_every_sample_fits():
    assert untrained_tails({"truncated": 0, "truncated_tokens": 0, "tokens": 100}, 64, 60, "f/") is None
    line = untrained_tails({"truncated": 2, "truncated_tokens": 25, "tokens": 75}, 64, 80, "f/")
    assert line is not None and "2 training samples" in line and "last 25 tokens (25.0% of the split)" in line
    assert "--max-seq-len 80" in line and "\n" not in line


def commands(text: str) -> list[str]:
    """The command lines of a document, continuation lines joined."""
    return re.sub(r"\\\n\s*", " ", text).splitlines()


def flag(line: str, name: str) -> int | None:
    found = re.search(rf"{name} (\d+)", line)
    return int(found.group(1)) if found else None


def test_the_readme_and_guide_routes_prepare_the_length_their_recipes_train():
    for doc in ("README.md", "docs/guide.md"):
        lines = commands((ROOT / doc).read_text(encoding="utf-8"))
        prepares = [line for line in lines if "eagle3-hf prepare " in line and "--input" in line]
        lengths = {flag(line, "--max-seq-len") for line in prepares}
        assert prepares and len(lengths) == 1 and None not in lengths, (doc, prepares)
        length = lengths.pop()
        trains = [line for line in lines if re.search(r"examples/train\.py|eagle3-hf train ", line)
                  and "--config" in line]
        assert trains, doc
        for line in trains:
            recipe = re.search(r"--config (\S+\.yaml)", line).group(1)
            rows = flag(line, "--max-seq-len") or yaml.safe_load((ROOT / recipe).read_text())["max_seq_len"]
            assert rows == length, (doc, line)
        for line in lines:
            if re.search(r"eagle3_hf\.cli extract|eagle3-hf (extract|serve-vllm|serve-features) ", line):
                context = flag(line, "--max-model-len")
                assert context is None or context > length, (doc, line)  # every prepared sample fits
