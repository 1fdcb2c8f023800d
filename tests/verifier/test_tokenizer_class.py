"""One trust policy from prepare to evaluate: a checkpoint that ships both transformers' fast tokenizer and its own
(remote-code) class loads the one or the other depending on --trust-remote-code. `prepare` records the class it
used; `extract`, `train` and `evaluate` refuse another class in one line naming both, and run with the same flag."""

from __future__ import annotations

import json
import shutil

import pytest

from eagle3_hf import cli
from eagle3_hf.constants import PREPARE_META
from eagle3_hf.data.conversations import write_jsonl
from eagle3_hf.verifier import remote_code

from tests.helpers.slow_tokenizer import CLASS_NAME, install_slow_tokenizer

FLAG = "--trust-remote-code"
CONVS = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                                      {"role": "assistant", "content": f"{i} + {i} is {2 * i}."}]} for i in range(6)]


def refusal(where, recorded: str, flag_before: str, loaded: str, flag_now: str) -> str:
    return (f"error: {where}: tokenized by {recorded} ({flag_before} {FLAG}), but this command loaded {loaded} "
            f"({flag_now} {FLAG}): give every stage the {FLAG} that prepare had")


@pytest.fixture(scope="module")
def dual_dir(tmp_path_factory, tiny_verifier_dir):
    """The tiny verifier with both tokenizers: transformers' fast one (tokenizer.json) and its own slow class."""
    path = tmp_path_factory.mktemp("dual") / "verifier"
    shutil.copytree(tiny_verifier_dir, path)
    install_slow_tokenizer(tiny_verifier_dir, path, keep_fast=True)
    yield path
    remote_code.set_trusted(False)


@pytest.fixture(scope="module")
def trusted_prepared(tmp_path_factory, dual_dir):
    root = tmp_path_factory.mktemp("trusted_prepared")
    write_jsonl(root / "convs.jsonl", CONVS)
    assert cli.main(["prepare", "--tokenizer", str(dual_dir), "--input", str(root / "convs.jsonl"), "--output",
                     str(root / "prepared"), FLAG]) == 0
    return root / "prepared"


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_extract_refuses_data_tokenized_by_another_class(dual_dir, trusted_prepared, tmp_path, capsys):
    meta = json.loads((trusted_prepared / PREPARE_META).read_text())
    assert (meta["tokenizer_class"], meta["trust_remote_code"]) == (CLASS_NAME, True)
    argv = ["extract", "--verifier", str(dual_dir), "--data", str(trusted_prepared), "--output", str(tmp_path / "f"),
            "--no-progress"]
    assert cli.main(argv) == 1
    assert errors(capsys) == [refusal(trusted_prepared / PREPARE_META, CLASS_NAME, "with", "TokenizersBackend",
                                      "without")]
    assert not (tmp_path / "f").exists()
    assert cli.main([*argv, FLAG]) == 0
    manifest = json.loads((tmp_path / "f" / "manifest.json").read_text())
    assert (manifest["tokenizer_class"], manifest["trust_remote_code"]) == (CLASS_NAME, True)  # carried on


def test_evaluate_refuses_a_drafter_trained_on_another_class(dual_dir, tmp_path, capsys):
    from eagle3_hf.verifier.loading import load_verifier

    from tests.helpers.drafters import random_drafter

    drafter = random_drafter(load_verifier(str(dual_dir)), draft_vocab_size=300)
    drafter.config.verifier_tokenizer_class = CLASS_NAME  # what train records from the features
    drafter.save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "Name a color."}\n')
    argv = ["evaluate", "--drafter", str(tmp_path / "drafter"), "--verifier", str(dual_dir), "--prompts",
            str(prompts), "--k", "2", "--max-new-tokens", "4", "--output", str(tmp_path / "eval"), "--no-progress"]
    assert cli.main(argv) == 1
    [line] = errors(capsys)
    assert line.endswith(f"tokenized by {CLASS_NAME}, but this command loaded TokenizersBackend (without {FLAG}): "
                         f"give every stage the {FLAG} that prepare had") and "the drafter" in line
    assert cli.main([*argv, FLAG]) == 0


def test_train_refuses_features_of_another_class_and_records_the_class(dual_dir, trusted_prepared, tmp_path,
                                                                       capsys):
    features = tmp_path / "f"
    assert cli.main(["extract", "--verifier", str(dual_dir), "--data", str(trusted_prepared), "--output",
                     str(features), "--no-progress", FLAG]) == 0
    assert cli.main(["vocab", "--data", str(trusted_prepared), "--draft-vocab-size", "64", "--output",
                     str(features / "vocab.safetensors")]) == 0
    argv = ["train", "--verifier", str(dual_dir), "--features", str(features), "--output-dir", str(tmp_path / "run"),
            "--max-seq-len", "64", "--max-steps", "1", "--per-device-train-batch-size", "1", "--report-to", "none",
            "--disable-tqdm", "true", "--save-strategy", "no", "--eval-strategy", "no"]
    capsys.readouterr()
    assert cli.main(argv) == 1
    assert errors(capsys) == [refusal(features, CLASS_NAME, "with", "TokenizersBackend", "without")]
    assert cli.main([*argv, "--trust_remote_code", "true"]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["verifier_tokenizer_class"] == CLASS_NAME
