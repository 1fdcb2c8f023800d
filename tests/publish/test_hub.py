"""Publishing through the real huggingface_hub client against the loopback Hub: push, card, download, errors."""

from __future__ import annotations

import json
import logging
import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_hf.errors import USER_ERRORS
from eagle3_hf.publish.check import check_drafter
from eagle3_hf.publish.hub import DrafterCheckError, HubError, hub_errors, push_drafter
from eagle3_hf.publish.model_card import CARD_MARKER, build_model_card, serve_commands, write_model_card

from tests.helpers.drafters import write_drafter
from tests.helpers.hub_server import READ_TOKEN as READ
from tests.helpers.hub_server import WRITE_TOKEN as WRITE
from tests.helpers.hub_server import client_pointed_at

ROOT = Path(__file__).resolve().parents[2]

TRAINING = {
    "verifier": "moonshotai/Kimi-K2.5",
    "data": {"name": "org/kimi-chats", "num_samples": 10000, "num_tokens": 17300000},
    "recipe": {"epochs": 5, "learning_rate": 3e-5, "max_seq_len": 2048, "ttt_steps": 3, "step_weight": 0.8,
               "init": "scratch"},
    "metrics": {"step_accuracy": [0.74, 0.47, 0.26], "step_conditional_accuracy": [0.74, 0.64, 0.56],
                "simulated_acceptance_length": 2.48},
}
EVALUATION = {"engine": "sglang", "k": 3, "temperature": 0.0, "prompts": "mt-bench", "num_prompts": 80,
              "acceptance_length": 2.69, "per_position_acceptance": [0.74, 0.47, 0.26], "speedup": 1.31,
              "lossless": True}


@pytest.fixture
def client(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", WRITE)
    with client_pointed_at(hub.url, cache_dir=tmp_path / "cache"):
        yield hub


def drafter(tmp_path, name="drafter", training=TRAINING, evaluation=None):
    path = write_drafter(tmp_path / name)
    if training is not None:
        (path / "eagle3_training.json").write_text(json.dumps(training))
    if evaluation is not None:
        (path / "eagle3_evaluation.json").write_text(json.dumps(evaluation))
    return path


def test_push_download_round_trip_with_card_and_revision(client, tmp_path):
    from huggingface_hub import HfApi, ModelCard, hf_hub_download, snapshot_download

    src = drafter(tmp_path)
    url = push_drafter(src, "tester/kimi-eagle3")
    api = HfApi()
    first = api.model_info("tester/kimi-eagle3").sha
    assert url.endswith(first) and url.oid == first
    files = set(api.list_repo_files("tester/kimi-eagle3"))
    assert {"config.json", "model.safetensors", "README.md", "eagle3_training.json"} <= files
    assert next(f for f in api.list_repo_tree("tester/kimi-eagle3") if f.path == "model.safetensors").lfs is not None
    local = snapshot_download("tester/kimi-eagle3")
    expected, got = load_file(src / "model.safetensors"), load_file(os.path.join(local, "model.safetensors"))
    assert expected.keys() == got.keys()  # bf16 on the Hub (push's default); d2t and t2d as stored
    assert all(torch.equal(expected[k].to(torch.bfloat16) if expected[k].is_floating_point() else expected[k], got[k])
               for k in expected)
    assert got["d2t"].dtype == torch.int64 and got["t2d"].dtype == torch.bool
    assert got["fc.weight"].dtype == torch.bfloat16
    assert json.load(open(os.path.join(local, "config.json")))["dtype"] == "bfloat16"

    card = ModelCard.load("tester/kimi-eagle3")
    assert card.data.base_model == "moonshotai/Kimi-K2.5" and card.data.library_name == "transformers"
    assert set(card.data.tags) >= {"eagle3", "speculative-decoding", "sglang", "vllm"}
    for command in serve_commands("moonshotai/Kimi-K2.5", "tester/kimi-eagle3").values():
        assert command in card.text
    assert "| 1 | 47.0 % | 64.0 % |" in card.text and "τ: not measured" in card.text
    assert check_drafter("tester/kimi-eagle3") == []  # check by repo id, through the Hub

    (src / "eagle3_evaluation.json").write_text(json.dumps(EVALUATION))
    push_drafter(src, "tester/kimi-eagle3", revision="measured", commit_message="add τ")
    assert "τ: not measured" in ModelCard.load("tester/kimi-eagle3").text  # main is unchanged
    measured = open(hf_hub_download("tester/kimi-eagle3", "README.md", revision="measured")).read()
    assert "τ = **2.69**" in measured and "engine: sglang, chain drafting with k = 3" in measured
    assert "temperature 0.0" in measured and "mt-bench (80 prompts)" in measured
    old = open(hf_hub_download("tester/kimi-eagle3", "README.md", revision=first)).read()
    assert "τ: not measured" in old
    assert {b.name for b in api.list_repo_refs("tester/kimi-eagle3").branches} == {"main", "measured"}


def test_push_refuses_a_checkpoint_that_would_not_serve(client, tmp_path):
    from huggingface_hub import HfApi

    broken = write_drafter(tmp_path / "broken", drop=("lm_head.weight",))
    with pytest.raises(DrafterCheckError) as err:
        push_drafter(broken, "tester/broken")
    assert "missing-lm-head" in str(err.value)
    assert not HfApi().repo_exists("tester/broken")


def assert_token_free(exc, token, caplog):
    text = str(exc) + repr(exc) + "".join(traceback.format_exception(exc)) + caplog.text
    assert token not in text


def test_wrong_token_is_a_clear_error_without_the_token(client, tmp_path, caplog):
    bad = "hf_definitely_wrong_token_987654321"
    caplog.set_level(logging.DEBUG)
    with pytest.raises(HubError) as err:
        push_drafter(drafter(tmp_path), "tester/denied", token=bad)
    assert "authentication failed" in str(err.value) and "HF_TOKEN" in str(err.value)
    assert isinstance(err.value, USER_ERRORS)  # every command prints it as one line, not a traceback
    assert_token_free(err.value, bad, caplog)


def test_read_only_token_and_foreign_namespace(client, tmp_path, caplog):
    with pytest.raises(HubError) as err:
        push_drafter(drafter(tmp_path), "reader/x", token=READ)
    assert "no write access" in str(err.value)
    assert_token_free(err.value, READ, caplog)
    with pytest.raises(HubError, match="no write access"):
        push_drafter(drafter(tmp_path, "d2"), "someone-else/x")


def test_network_failure_and_missing_token(tmp_path, monkeypatch):
    from huggingface_hub import constants

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_TOKEN", WRITE)
    with client_pointed_at(f"http://127.0.0.1:{port}"):
        with pytest.raises(HubError, match="network failure") as err:
            push_drafter(drafter(tmp_path), "tester/offline")
        assert WRITE not in str(err.value)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"), raising=False)
    with pytest.raises(HubError, match="no Hugging Face token"):
        push_drafter(drafter(tmp_path, "d2"), "tester/anon")


def test_conflict_is_translated(client):
    from huggingface_hub import HfApi

    HfApi().create_repo("tester/exists")
    with pytest.raises(HubError, match="conflict"):
        with hub_errors("create", "tester/exists", WRITE):
            HfApi().create_repo("tester/exists")


def test_cli_push(client, tmp_path, capsys):
    from huggingface_hub import hf_hub_download

    from eagle3_hf.cli import main

    assert main(["push", str(drafter(tmp_path)), "--repo-id", "tester/cli", "--revision", "dev"]) == 0
    assert "/tester/cli/commit/" in capsys.readouterr().out
    assert json.load(open(hf_hub_download("tester/cli", "config.json", revision="dev")))["draft_vocab_size"] == 100
    broken = write_drafter(tmp_path / "broken", norm_before_residual=True)
    assert main(["push", str(broken), "--repo-id", "tester/cli2"]) == 1
    assert "norm-before-residual" in capsys.readouterr().err
    assert main(["push", str(broken), "--repo-id", "tester/cli2", "--no-check"]) == 0


def test_push_a_model_object_and_load_it_back(client, tmp_path):
    from eagle3_hf import Eagle3DraftModel

    from tests.helpers.drafters import tiny_model, vocab_mapping

    model = tiny_model()
    model.set_vocab_mapping(*vocab_mapping(model.config.vocab_size, model.config.draft_vocab_size))
    push_drafter(model, "tester/from-model", revision="v1")
    loaded = Eagle3DraftModel.from_pretrained("tester/from-model", revision="v1")
    state, back = model.state_dict(), loaded.state_dict()
    assert set(back) == set(state) - {"embed_tokens.weight"} or set(back) == set(state)
    for name, tensor in back.items():  # the pushed weights are the fp32 ones within bf16 rounding
        if not state[name].is_floating_point():
            assert torch.equal(state[name], tensor) and tensor.dtype == state[name].dtype, name  # d2t, t2d
        elif name != "embed_tokens.weight":  # loaded in fp32 here: the bf16 values, exactly
            torch.testing.assert_close(tensor.float(), state[name], rtol=2**-8, atol=0, msg=name)
            assert torch.equal(tensor, state[name].to(torch.bfloat16).to(tensor.dtype)), name
    push_drafter(model, "tester/from-model-fp32", dtype="fp32")  # told: the weights as trained, bit for bit
    exact = Eagle3DraftModel.from_pretrained("tester/from-model-fp32").state_dict()
    assert all(torch.equal(state[k], exact[k]) for k in ("lm_head.weight", "fc.weight", "d2t", "t2d"))


def test_the_card_serves_a_remote_code_verifier_over_the_gpus_that_hold_it(client, tmp_path):
    """A Kimi-K2.5-shaped verifier (its config sizes, INT4 experts, auto_map in config and tokenizer config, no
    weights): the serve commands carry --tp 8 / --tensor-parallel-size 8 on 141 GiB GPUs and --trust-remote-code;
    the card says why, and the drafter's dtype."""
    from huggingface_hub import ModelCard

    from eagle3_hf.publish.serving import verifier_serving

    verifier = tmp_path / "kimi"
    verifier.mkdir()
    config = json.loads((ROOT / "examples/recipes/kimi_k25_text_config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_kimi.KimiConfig"}
    (verifier / "config.json").write_text(json.dumps(config))
    (verifier / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["tok.T", None]}}))
    facts = verifier_serving(str(verifier), gpu_gib=141)
    assert facts.tensor_parallel == 8 and facts.trust_remote_code
    assert facts.remote_code_files == ("config.json", "tokenizer_config.json")
    on_h100 = verifier_serving(str(verifier), gpu_gib=80)  # 594 GB > 80 % of 8 x 80 GiB
    assert on_h100.tensor_parallel == 16 and "more than one 8-GPU node" in on_h100.tp_basis
    assert verifier_serving(str(verifier), tensor_parallel=4).tensor_parallel == 4
    src = drafter(tmp_path, training=dict(TRAINING, verifier=str(verifier)))
    push_drafter(src, "tester/kimi-tp", gpu_memory_gib=141, run_check=False)
    text = ModelCard.load("tester/kimi-tp").text
    assert "python -m sglang.launch_server --model VERIFIER --tp 8 --trust-remote-code" in text
    assert "vllm serve VERIFIER --tensor-parallel-size 8 --trust-remote-code --speculative-config" in text
    assert "Tensor parallel 8: the fewest GPUs of 141 GiB" in text and "Drafter weights: bfloat16" in text
    assert "config.json and tokenizer_config.json name code of its own" in text
    # a verifier that cannot be read: no flags, and the card says the size was not derived
    plain = serve_commands("org/verifier", "org/drafter")
    assert "--tp" not in plain["sglang"] and "--tensor-parallel-size" not in plain["vllm"]
    assert "Tensor parallel: not derived" in build_model_card(drafter(tmp_path, "d3")).text


# -- the card alone ----------------------------------------------------------------------------------------

def test_card_states_what_was_not_measured(tmp_path):
    card = build_model_card(drafter(tmp_path, training=None))
    assert "τ: not measured" in card.text and "Per-step accuracy: not measured" in card.text
    assert "| epochs | not recorded |" in card.text
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"  # from config.json provenance
    partial = dict(EVALUATION, speedup=None, per_position_acceptance=None, lossless=None, temperature=None)
    card = build_model_card(drafter(tmp_path, "p", evaluation=partial))
    assert "Wall-clock speedup over plain greedy decoding on the same machine: not measured" in card.text
    assert "temperature not recorded" in card.text and "Lossless: not measured" in card.text


def test_card_from_local_verifier_path_has_no_base_model(tmp_path):
    path = drafter(tmp_path, training=dict(TRAINING, verifier=str(tmp_path)))
    card = build_model_card(path, "org/name")
    assert card.data.base_model is None and "--model VERIFIER" in card.text and str(tmp_path) not in card.data.to_yaml()


def test_write_model_card_keeps_a_foreign_readme(tmp_path):
    from huggingface_hub import ModelCard

    path = drafter(tmp_path)
    (path / "README.md").write_text("# my own notes\n")
    write_model_card(path)
    assert (path / "README.md").read_text() == "# my own notes\n"
    write_model_card(path, overwrite=True)
    assert CARD_MARKER in (path / "README.md").read_text()
    assert ModelCard.load(path / "README.md").data.tags[0] == "eagle3"
    write_model_card(path, "org/new")  # ours: rewritten
    assert "org/new" in (path / "README.md").read_text()


def test_push_to_hub_refuses_an_argument_it_would_drop_and_takes_transformers_ones(client, tmp_path):
    from huggingface_hub import HfApi, ModelCard, hf_hub_download

    from tests.helpers.drafters import tiny_model, vocab_mapping

    model = tiny_model()
    model.set_vocab_mapping(*vocab_mapping(model.config.vocab_size, model.config.draft_vocab_size))
    with pytest.raises(TypeError) as err:
        model.push_to_hub("tester/args", use_temp_dir=True, safe_serialization=True)
    assert str(err.value) == ("push_to_hub: unknown argument(s) safe_serialization, use_temp_dir (it takes token, "
                              "private, revision, commit_message, commit_description, create_pr, tags, run_check)")
    with pytest.raises(ValueError, match="max_shard_size is not taken: a drafter is pushed as one model.safetensors"):
        model.push_to_hub("tester/args", max_shard_size="1MB")
    assert not HfApi().repo_exists("tester/args")  # refused before anything was created
    model.push_to_hub("tester/args", tags=["my-tag"], commit_description="first drafter")
    card = ModelCard.load(hf_hub_download("tester/args", "README.md"))
    assert "my-tag" in card.data.tags and "eagle3" in " ".join(card.data.tags)


def test_export_takes_push_dtypes_and_keeps_the_vocabulary_maps(tmp_path):
    """`export --dtype bf16` writes what `push` uploads by default; d2t stays int64 and t2d bool."""
    from eagle3_hf.cli import main

    src = drafter(tmp_path)
    assert main(["export", str(src), "--output", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    got, before = load_file(tmp_path / "bf16" / "model.safetensors"), load_file(src / "model.safetensors")
    assert got["fc.weight"].dtype == torch.bfloat16 and torch.equal(got["fc.weight"],
                                                                    before["fc.weight"].to(torch.bfloat16))
    assert got["d2t"].dtype == torch.int64 and got["t2d"].dtype == torch.bool
    assert torch.equal(got["d2t"], before["d2t"]) and torch.equal(got["t2d"], before["t2d"])
    assert main(["export", str(src), "--output", str(tmp_path / "same")]) == 0
    assert load_file(tmp_path / "same" / "model.safetensors")["fc.weight"].dtype == before["fc.weight"].dtype


def test_push_gguf_beside_the_standard_layout_checks_llamacpp_too(client, tmp_path):
    from huggingface_hub import HfApi, hf_hub_download

    src = drafter(tmp_path)
    gguf = tmp_path / "gguf" / "eagle3-drafter-f16.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(60))  # its bytes travel as they are; llama.cpp's converter wrote the real one
    push_drafter(src, "tester/with-gguf", gguf=gguf)
    files = set(HfApi().list_repo_files("tester/with-gguf"))
    assert {"eagle3-drafter-f16.gguf", "model.safetensors", "config.json", "README.md"} <= files
    assert open(hf_hub_download("tester/with-gguf", "eagle3-drafter-f16.gguf"), "rb").read() == gguf.read_bytes()
    assert not (src / "README.md").exists()  # the card is written in the staging folder, not the user's
    card = open(hf_hub_download("tester/with-gguf", "README.md"), encoding="utf-8").read()
    assert "llama-server -m VERIFIER.gguf -md eagle3-drafter-f16.gguf --spec-type draft-eagle3" in card
    # an EAGLE 3.1 drafter serves in vLLM and SGLang: pushed alone, it goes; with a GGUF, llama.cpp's rules refuse it
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, norm_output=True)))
    push_drafter(src, "tester/eagle31")
    with pytest.raises(DrafterCheckError, match="llamacpp-norm-output"):
        push_drafter(src, "tester/eagle31-gguf", gguf=gguf)
    with pytest.raises(FileNotFoundError, match="no such file"):
        push_drafter(src, "tester/x", gguf=tmp_path / "missing.gguf")
