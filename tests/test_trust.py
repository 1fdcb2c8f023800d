"""Trust at every boundary: what a server's answer, a features directory or a checkpoint says is checked before
it is acted on, and every refusal is the one line the user sees, with the target left as it was.

The endpoint cases run `extract --engine vllm --endpoint` against a server that lies in its first answer
(tests/helpers/hostile_vllm.py); the rest each feed one malformed input to the function that guards it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from eagle3_hf.cli import main

from tests.helpers.completions_stub import CompletionsStub
from tests.helpers.hostile_vllm import HostileStub
from tests.helpers.serveable import serveable_verifier, walk_prepared

REFUSED = "refused (nothing read or removed)"


@pytest.fixture(scope="module")
def model():
    return serveable_verifier()


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, model, tokenizer):
    path = tmp_path_factory.mktemp("serveable")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def prepared(tmp_path, fingerprint):
    return walk_prepared(tmp_path / "prepared", fingerprint, n=4)


def extract(url: str, verifier_dir: Path, prepared: Path, out: Path, *extra: str) -> int:
    return main(["extract", "--engine", "vllm", "--endpoint", url, "--verifier", str(verifier_dir), "--data",
                 str(prepared), "--output", str(out), "--vllm-batch-size", "1", "--no-progress", *extra])


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def expected_line(attack: str, stub: HostileStub) -> str:
    url, storage, victim = stub.url, os.path.realpath(stub.storage), os.path.realpath(stub.victim)
    answered = stub.answered[0] if stub.answered else ""
    name = os.path.basename(answered)
    where = f"{url} answered hidden_states_path {answered!r}"
    return "error: " + {
        "outside": f"{where}, outside its storage {storage}: {REFUSED}",
        "dotdot": f"{where}, which has a '..' component: {REFUSED}",
        "symlink": f"{where}, which resolves to {victim}/precious.safetensors, outside its storage {storage}: "
                   f"{REFUSED}",
        "lock-symlink": f"{where}, whose .lock resolves to {victim}/precious.lock, outside its storage {storage}: "
                        f"{REFUSED}",
        "late-symlink": f"{storage}/{name} became a symlink (to {victim}/precious.safetensors) after {url} "
                        f"answered: {REFUSED}",
        "foreign-name": f"{where}, not the name vLLM's connector gives this request's file "
                        f"(cmpl-<request id>-0-<suffix>.safetensors): {REFUSED}",
        "stale-name": f"{where}, not the name vLLM's connector gives this request's file "
                      f"(cmpl-<request id>-0-<suffix>.safetensors): {REFUSED}",
        "relative": f"{where}, not an absolute path: {REFUSED}",
        "oversized": f"{url} sent more than 1024 KiB for one answer: not what vLLM sends; refused",
        "slow": f"{url} did not answer a completion within 1 s (--vllm-timeout sets the limit)",
    }[attack]


@pytest.mark.parametrize("attack", ["outside", "dotdot", "symlink", "lock-symlink", "late-symlink", "foreign-name",
                                    "stale-name", "relative", "oversized", "slow"])
def test_a_hostile_answer_is_refused_in_one_line_and_nothing_outside_is_touched(tmp_path, model, verifier_dir,
                                                                                 prepared, attack, capsys):
    storage, victim = tmp_path / "storage", tmp_path / "victim"
    with HostileStub(model, str(verifier_dir), storage, victim, attack) as stub:
        code = extract(stub.url, verifier_dir, prepared, tmp_path / "f", "--vllm-timeout", "1")
        assert code == 1
        assert errors(capsys) == [expected_line(attack, stub)]
    for path, before in stub.untouched.items():  # the bait: still there, as it was
        if isinstance(before, str):
            assert path.is_symlink() and os.readlink(path) == before, path
        else:
            assert path.read_bytes() == before, path
    if attack in ("oversized", "slow"):  # the client never learnt the honest file's name: it lies there still
        assert [p.name for p in storage.glob("*.safetensors")] == [os.path.basename(stub.answered[0])]
    assert not list((tmp_path / "f").glob("shard-*"))


def test_a_server_that_names_no_storage_is_kept_to_its_first_answers_directory(tmp_path, model, verifier_dir,
                                                                                prepared, capsys):
    storage = tmp_path / "storage"
    with CompletionsStub(model, str(verifier_dir), storage, name_storage=False) as stub:
        assert extract(stub.url, verifier_dir, prepared, tmp_path / "f") == 0
    err = capsys.readouterr().err
    assert (f"[extract] {stub.url} does not name its storage directory: reading and deleting only its files in "
            f"{os.path.realpath(storage)} (--vllm-storage sets it)") in err
    assert os.listdir(storage) == []


def test_vllm_storage_that_contradicts_the_server_is_refused_before_any_request(tmp_path, model, verifier_dir,
                                                                                  prepared, capsys):
    (tmp_path / "mine").mkdir()
    with CompletionsStub(model, str(verifier_dir), tmp_path / "storage") as stub:
        code = extract(stub.url, verifier_dir, prepared, tmp_path / "f", "--vllm-storage", str(tmp_path / "mine"))
        assert code == 1 and stub.posts == 0
    assert errors(capsys) == [f"error: {stub.url} writes its states to {tmp_path / 'storage'}, not --vllm-storage "
                              f"{tmp_path / 'mine'}"]


# ---------------------------------------------------------------- features of an unfinished extraction

def test_training_on_an_unfinished_extraction_is_refused_unless_allowed(synthetic, tmp_path, capsys):
    import shutil

    features = tmp_path / "features"
    shutil.copytree(synthetic["features"], features)
    (features / "manifest.json").unlink()  # `extract` still running, or killed: journals only
    args = ["train", "--verifier", str(synthetic["verifier_dir"]), "--features", str(features), "--output-dir",
            str(tmp_path / "run"), "--max-seq-len", "64", "--max-steps", "1", "--per-device-train-batch-size", "1",
            "--report-to", "none", "--disable-tqdm", "true", "--save-strategy", "no", "--eval-strategy", "no"]
    assert main(args) == 1
    assert errors(capsys) == [f"error: {features}: an unfinished extraction (no manifest.json; its journals hold 48 "
                              "samples): rerun the extract command to finish it, or pass --allow-partial-features "
                              "to use what is there"]
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert main([*args, "--allow-partial-features"]) == 0
    err = capsys.readouterr().err
    assert (f"[features] warning: {features}: an unfinished extraction (no manifest.json; its journals hold 48 "
            "samples): using 48 samples (--allow-partial-features)") in err
    assert not (features / "manifest.json").exists()  # reading never merges: the writer's rerun does


# ---------------------------------------------------------------- the verifier's head and embedding

def _untied_checkpoint_without_head(path: Path, tie: bool) -> Path:
    """A tiny Llama saved with its lm_head tensor removed from model.safetensors."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors.pop("lm_head.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if tie:  # the same files, but the config says the head is the embedding
        import json

        config_file = path / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tie_word_embeddings": True}))
    return path


def test_a_missing_head_is_the_embedding_only_when_the_config_ties_them(tmp_path):
    from eagle3_hf.verifier.checkpoint_files import verifier_io_weights
    from eagle3_hf.verifier.head import load_verifier_head

    untied = _untied_checkpoint_without_head(tmp_path / "untied", tie=False)
    with pytest.raises(ValueError) as err:
        load_verifier_head(untied)
    assert str(err.value) == (f"{untied}: no *lm_head.weight tensor in {untied / 'model.safetensors'} and its "
                              "config.json has tie_word_embeddings false: the head is its own tensor")
    with pytest.raises(ValueError) as err:
        verifier_io_weights(str(untied))
    assert str(err.value) == (f"{untied}: no *lm_head.weight tensor in {untied / 'model.safetensors'} and its "
                              "config.json has tie_word_embeddings false: the head is not the embedding")
    tied = _untied_checkpoint_without_head(tmp_path / "tied", tie=True)
    _norm, head, _config = load_verifier_head(tied)
    embed, head_weight = verifier_io_weights(str(tied))
    assert head.weight.equal(embed) and head_weight.equal(embed)


def test_an_unreachable_or_private_verifier_is_not_called_missing(hub, tmp_path):
    from huggingface_hub import constants

    from eagle3_hf.verifier.checkpoint_files import verifier_io_weights

    from tests.helpers.hub_server import client_pointed_at

    with client_pointed_at(hub.url, cache_dir=tmp_path / "cache"):
        with pytest.raises(OSError) as err:
            verifier_io_weights("nobody/private-verifier")
        assert str(err.value) == ("cannot read model.safetensors.index.json of nobody/private-verifier from the Hub: "
                                  "no such repository, or a private one HF_TOKEN cannot see")
        constants.HF_HUB_OFFLINE = True  # restored on leaving client_pointed_at
        with pytest.raises(OSError) as err:
            verifier_io_weights("org/verifier")
        assert str(err.value) == ("cannot read model.safetensors.index.json of org/verifier from the Hub: the Hub "
                                  "cannot be reached (network, proxy or HF_HUB_OFFLINE=1) and the file is not in the "
                                  "local cache")


# ---------------------------------------------------------------- an empty validation split

def test_an_empty_validation_split_reports_no_metrics_instead_of_fake_ones(synthetic, tmp_path, caplog):
    import json
    import logging

    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="eagle3_hf.train"):
        assert main(["train", "--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
                     "--output-dir", str(run), "--max-seq-len", "64", "--num-train-epochs", "1",
                     "--per-device-train-batch-size", "8", "--validation-fraction", "0", "--report-to", "none",
                     "--disable-tqdm", "true"]) == 0
    assert ("the validation split is empty (--validation-fraction 0.0): evaluation is off, no accuracy or simulated "
            "τ is reported") in caplog.messages
    summary = json.loads((run / "eagle3_training.json").read_text())
    assert summary["metrics"] == {"step_accuracy": [None] * 3, "step_conditional_accuracy": [None] * 3,
                                  "simulated_acceptance_length": None}
    assert not [h for h in summary["log_history"] if any(k.startswith("eval_") for k in h)]  # no accuracy 0, τ 1.0
