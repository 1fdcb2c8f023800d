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
from tests.helpers.serveable import walk_prepared

REFUSED = "refused (nothing read or removed)"


@pytest.fixture
def prepared(tmp_path, fingerprint):
    return walk_prepared(tmp_path / "prepared", fingerprint, n=4)


def extract(url: str, serveable_dir: Path, prepared: Path, out: Path, *extra: str) -> int:
    return main(["extract", "--engine", "vllm", "--endpoint", url, "--verifier", str(serveable_dir), "--data",
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
def test_a_hostile_answer_is_refused_in_one_line_and_nothing_outside_is_touched(
        tmp_path, serveable_model, serveable_dir, prepared, attack, capsys):
    storage, victim = tmp_path / "storage", tmp_path / "victim"
    with HostileStub(serveable_model, str(serveable_dir), storage, victim, attack) as stub:
        code = extract(stub.url, serveable_dir, prepared, tmp_path / "f", "--vllm-timeout", "1")
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


def test_a_server_that_names_no_storage_is_kept_to_its_first_answers_directory(tmp_path, serveable_model, serveable_dir,
                                                                                prepared, capsys):
    storage = tmp_path / "storage"
    with CompletionsStub(serveable_model, str(serveable_dir), storage, name_storage=False) as stub:
        assert extract(stub.url, serveable_dir, prepared, tmp_path / "f") == 0
    err = capsys.readouterr().err
    assert (f"[extract] {stub.url} does not name its storage directory: reading and deleting only its files in "
            f"{os.path.realpath(storage)} (--vllm-storage sets it)") in err
    assert os.listdir(storage) == []


def test_vllm_storage_that_contradicts_the_server_is_refused_before_any_request(tmp_path, serveable_model,
                                                                                  serveable_dir, prepared, capsys):
    (tmp_path / "mine").mkdir()
    with CompletionsStub(serveable_model, str(serveable_dir), tmp_path / "storage") as stub:
        code = extract(stub.url, serveable_dir, prepared, tmp_path / "f", "--vllm-storage", str(tmp_path / "mine"))
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


# ---------------------------------------------------------------- the feature server: who may ask, and what

KEY = "s3cret-key-never-shown"


def test_a_bad_request_is_answered_alone_and_the_rest_of_its_batch_is_served(monkeypatch):
    """Four trainers at once, one sending an id outside the vocabulary (or too many ids, or not integers): its
    request is a 400 before it joins a batch; the others are batched together and served, first time."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from eagle3_hf.features.routes.feature_server_client import FeatureClient, FeatureServerError

    from tests.helpers.feature_engine import MAX_MODEL_LEN, VOCAB, ScriptServer, fake_engine, states

    monkeypatch.delenv("EAGLE3_HF_API_KEY", raising=False)
    good = {f"s{i}": [1 + i, 2 + i, 3 + i] for i in range(3)}
    bad = {"vocab": ([5, VOCAB, 7], f"token id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})"),
           "long": ([1] * MAX_MODEL_LEN, f"{MAX_MODEL_LEN} tokens: the server takes 1..{MAX_MODEL_LEN - 1} "
                                         f"(--max-model-len {MAX_MODEL_LEN}, one generated token)"),
           "negative": ([-1, 2], f"token id -1 is outside the vocabulary (0..{VOCAB - 1})")}
    for name, (ids, why) in bad.items():
        with ScriptServer(fake_engine()) as server:
            client = FeatureClient(server.url, retries=0)  # no second chance: the first answer must be right
            with ThreadPoolExecutor(4) as pool:
                futures = {sid: pool.submit(client.states, ids_, sid) for sid, ids_ in good.items()}
                futures[name] = pool.submit(client.states, ids, name)
                with pytest.raises(FeatureServerError) as err:
                    futures[name].result()
                assert str(err.value) == f"feature server {server.url}: sample {name!r} failed once ({why})"
                for sid, ids_ in good.items():
                    got = futures[sid].result()
                    assert all(torch.equal(got[k], v) for k, v in states(ids_).items()), sid
            assert ids not in [i for batch in server.engine.batches for i in batch]
            assert max(len(batch) for batch in server.engine.batches) > 1  # the good ones shared a batch


def test_a_missing_or_wrong_key_is_a_401_and_one_line_without_the_key(monkeypatch, caplog, capsys, tmp_path,
                                                                        serveable_dir, fingerprint):
    import json
    import urllib.error
    import urllib.request

    from tests.helpers.feature_engine import ScriptServer, fake_engine

    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=4)
    args = ["train", "--verifier", str(serveable_dir), "--prepared-dir", str(prepared), "--output-dir",
            str(tmp_path / "run"), "--max-steps", "1", "--report-to", "none", "--disable-tqdm", "true"]
    with ScriptServer(fake_engine(), api_key=KEY) as server:
        request = urllib.request.Request(server.url + "/features", data=json.dumps({"ids": [1, 2]}).encode(),
                                         headers={"Authorization": "Bearer nope"})
        with pytest.raises(urllib.error.HTTPError) as raw:
            urllib.request.urlopen(request, timeout=10)
        assert raw.value.code == 401 and raw.value.headers["WWW-Authenticate"] == "Bearer"
        monkeypatch.delenv("EAGLE3_HF_API_KEY", raising=False)
        assert main([*args, "--features", server.url]) == 1
        assert errors(capsys) == [f"error: feature server {server.url} requires an API key (401): set "
                                  "EAGLE3_HF_API_KEY to the key the server was started with"]
        monkeypatch.setenv("EAGLE3_HF_API_KEY", "wrong-" + KEY)
        assert main([*args, "--features", server.url]) == 1
        out = capsys.readouterr()
        assert [line for line in out.err.splitlines() if line.startswith("error:")] == [
            f"error: feature server {server.url} refused the API key in EAGLE3_HF_API_KEY (401): set it to the key "
            "the server was started with"]
        assert KEY not in out.out + out.err + caplog.text
        assert server.engine.requests == 0
        monkeypatch.setenv("EAGLE3_HF_API_KEY", KEY)  # the right key: served
        from eagle3_hf.features.routes.feature_server_client import FeatureClient

        client = FeatureClient(server.url, retries=0)
        assert client.identity()["verifier"] == "fake"
        assert client.states([4, 5], "keyed")["token_ids"].tolist() == [4, 5]


def test_a_full_queue_answers_503_with_retry_after_and_the_client_waits_that_long(monkeypatch):
    import json
    import threading
    import time
    import urllib.error
    import urllib.request

    from eagle3_hf.features.routes.feature_server_client import FeatureClient, FeatureServerError

    from tests.helpers.feature_engine import ScriptServer, fake_engine

    monkeypatch.delenv("EAGLE3_HF_API_KEY", raising=False)
    gate = threading.Event()
    with ScriptServer(fake_engine(batch_size=1, batch_wait_s=0.0, max_queue=2, gate=gate)) as server:
        def post(ids):
            request = urllib.request.Request(server.url + "/features", data=json.dumps({"ids": ids}).encode())
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    return answer.status, None
            except urllib.error.HTTPError as exc:
                return exc.code, exc.headers.get("Retry-After")

        held = [threading.Thread(target=post, args=([i + 1],), daemon=True) for i in range(3)]
        for thread in held:  # one in the engine (held at the gate), two waiting: the queue is full
            thread.start()
            time.sleep(0.2)
        assert post([9]) == (503, "1")
        with pytest.raises(FeatureServerError) as err:  # no retries left: one line naming the sample
            FeatureClient(server.url, retries=0).states([9], "flood")
        assert str(err.value) == (f"feature server {server.url}: sample 'flood' failed once (busy: 2 requests are "
                                  "waiting; retry after 1 s)")
        threading.Timer(0.3, gate.set).start()  # the engine frees up a moment later
        start = time.monotonic()
        got = FeatureClient(server.url, retries=3, backoff_s=0.01).states([9, 8], "patient")
        assert got["token_ids"].tolist() == [9, 8]
        assert time.monotonic() - start >= 0.9  # it waited the server's Retry-After, not its own 0.01 s
        for thread in held:
            thread.join(10)


@pytest.mark.parametrize("command", ["serve-features", "serve-vllm"])
def test_listening_beyond_loopback_without_a_key_is_refused_before_anything_loads(monkeypatch, capsys, tmp_path,
                                                                                   serveable_dir, command):
    monkeypatch.delenv("EAGLE3_HF_API_KEY", raising=False)
    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(tmp_path / "no-venv"))  # were the guard gone: another line
    assert main([command, "--verifier", str(serveable_dir), "--host", "0.0.0.0", "--port", "8123"]) == 1
    assert errors(capsys) == [f"error: {command} --host 0.0.0.0 without an API key would serve anyone who reaches "
                              "that address: set EAGLE3_HF_API_KEY (or pass --api-key), or keep --host 127.0.0.1 "
                              "and use an SSH tunnel"]


def test_the_feature_server_script_refuses_another_host_without_a_key_itself(monkeypatch):
    from tests.helpers.feature_engine import script

    monkeypatch.delenv("EAGLE3_HF_API_KEY", raising=False)
    with pytest.raises(PermissionError) as err:
        script().serve({"host": "0.0.0.0", "verifier": "unused"})
    assert str(err.value) == "--host 0.0.0.0 without an API key: set EAGLE3_HF_API_KEY or listen on 127.0.0.1"


def test_serve_vllm_prints_a_command_that_reads_the_key_and_never_shows_it(monkeypatch, capsys, serveable_dir):
    monkeypatch.setenv("EAGLE3_HF_API_KEY", KEY)
    assert main(["serve-vllm", "--verifier", str(serveable_dir), "--host", "0.0.0.0", "--connector", "cpu",
                 "--print-command"]) == 0
    out = capsys.readouterr()
    assert 'VLLM_API_KEY="$EAGLE3_HF_API_KEY" ' in out.out and "--api-key" not in out.out
    assert KEY not in out.out + out.err


def test_the_vllm_client_sends_the_key_and_a_refusal_is_one_line(monkeypatch, tmp_path, serveable_model, serveable_dir,
                                                                    prepared, capsys):
    with CompletionsStub(serveable_model, str(serveable_dir), tmp_path / "storage", api_key=KEY) as stub:
        monkeypatch.setenv("EAGLE3_HF_API_KEY", "wrong")
        assert extract(stub.url, serveable_dir, prepared, tmp_path / "f") == 1
        assert errors(capsys) == [f"error: {stub.url} refused the API key in EAGLE3_HF_API_KEY (401): set it to the "
                                  "key the server was started with"]
        monkeypatch.setenv("EAGLE3_HF_API_KEY", KEY)
        assert extract(stub.url, serveable_dir, prepared, tmp_path / "f") == 0
    assert KEY not in capsys.readouterr().err


# ---------------------------------------------------------------- the teacher is the features' verifier

def same_shape_other(src: Path, dst: Path, how: str) -> Path:
    """Another verifier of `src`'s shape: "config" (one config field differs, the tensors are the same) or
    "head" (the same config, the tensors stored in bfloat16)."""
    import json
    import shutil

    if how == "head":
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(src).to(torch_bfloat16()).save_pretrained(dst)
        for extra in src.glob("tokenizer*"):
            shutil.copy(extra, dst)
        return dst
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["rope_theta"] = float(config.get("rope_theta") or 10000.0) * 2
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def torch_bfloat16():
    import torch

    return torch.bfloat16


@pytest.fixture(scope="module")
def hashed(synthetic, tmp_path_factory):
    """Features extracted from the synthetic verifier loaded from its directory (so they record its hashes), the
    same extraction from the model in memory (no files: no hashes), and two same-shape other verifiers."""
    import shutil

    from transformers import AutoModelForCausalLM

    from eagle3_hf.features.routes.transformers import extract_features
    from eagle3_hf.features.write import StoreOptions

    from tests.helpers.data import FINGERPRINT, prepared_dataset

    root = tmp_path_factory.mktemp("hashed")
    prepared = prepared_dataset(root / "prepared", 12)
    verifier_dir = synthetic["verifier_dir"]
    for name, model, named in (("features", AutoModelForCausalLM.from_pretrained(verifier_dir), str(verifier_dir)),
                               ("unhashed", synthetic["verifier"], "in-memory")):
        extract_features(model, FINGERPRINT, prepared, root / name, aux_indices=[1, 3, 4], dtype="float32",
                         store=StoreOptions(16), verifier_name=named, progress=False)
        shutil.copy(synthetic["features"] / "vocab.safetensors", root / name)
    return {"features": root / "features", "unhashed": root / "unhashed", "verifier_dir": verifier_dir,
            "config": same_shape_other(verifier_dir, root / "other-config", "config"),
            "head": same_shape_other(verifier_dir, root / "other-head", "head")}


def train_args(features: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--features", str(features), "--output-dir", str(out), "--max-seq-len", "64", "--max-steps",
            "1", "--per-device-train-batch-size", "1", "--report-to", "none", "--disable-tqdm", "true",
            "--save-strategy", "no", "--eval-strategy", "no", *extra]


def test_features_record_the_hashes_and_their_shards_are_byte_for_byte_as_before(hashed):
    import json

    from eagle3_hf.verifier.identity import teacher_hashes

    manifest = json.loads((hashed["features"] / "manifest.json").read_text())
    assert {k: manifest["verifier"][k] for k in ("config_sha256", "head_sha256")} == \
        teacher_hashes(str(hashed["verifier_dir"]))
    plain = json.loads((hashed["unhashed"] / "manifest.json").read_text())
    assert "config_sha256" not in plain["verifier"]  # a model in memory, no files: nothing to hash
    shards = sorted(p.name for p in hashed["features"].glob("shard-*"))
    assert shards and shards == sorted(p.name for p in hashed["unhashed"].glob("shard-*"))
    for name in shards:
        assert (hashed["features"] / name).read_bytes() == (hashed["unhashed"] / name).read_bytes()


@pytest.mark.parametrize("how, key", [("config", "config_sha256"), ("head", "head_sha256")])
def test_training_against_a_same_shape_other_verifier_is_refused_naming_both(hashed, tmp_path, capsys, how, key):
    from eagle3_hf.verifier.identity import teacher_hashes

    other, features = hashed[how], hashed["features"]
    recorded, found = teacher_hashes(str(hashed["verifier_dir"]))[key], teacher_hashes(str(other))[key]
    assert main(train_args(features, tmp_path / "run", "--verifier", str(other))) == 1
    assert errors(capsys) == [f"error: {features}: features of the verifier {hashed['verifier_dir']}, not of "
                              f"--verifier {other} ({key} {recorded[:12]} != {found[:12]}): train with the verifier "
                              "the features were extracted from"]
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_verifier_defaults_to_the_features_verifier_and_old_features_warn(hashed, tmp_path, caplog):
    import json
    import logging
    import shutil

    with caplog.at_level(logging.INFO, logger="eagle3_hf.train"):
        assert main(train_args(hashed["features"], tmp_path / "run")) == 0  # no --verifier
    summary = json.loads((tmp_path / "run" / "eagle3_training.json").read_text())
    assert summary["verifier"] == str(hashed["verifier_dir"])
    assert not [m for m in caplog.messages if "could not be fully checked" in m]
    old = tmp_path / "old"  # a manifest written before the hashes were recorded
    shutil.copytree(hashed["features"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    for k in ("config_sha256", "head_sha256"):
        del manifest["verifier"][k]
    (old / "manifest.json").write_text(json.dumps(manifest))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="eagle3_hf.train"):
        assert main(train_args(old, tmp_path / "run-old", "--verifier", str(hashed["config"]))) == 0
    assert (f"{old}: the teacher could not be fully checked: no config_sha256 or head_sha256 on both sides "
            "(features from before they were recorded, or a verifier without files here); compared layers, widths, "
            f"vocabulary and tokenizer only; they name {hashed['verifier_dir']}, --verifier is {hashed['config']}"
            ) in caplog.messages


def test_a_feature_server_of_a_same_shape_other_verifier_is_refused_naming_both(
        tmp_path, serveable_model, serveable_dir, fingerprint, capsys, monkeypatch):
    from eagle3_hf.verifier.identity import teacher_hashes

    from tests.helpers.feature_stub import Stub, identity

    monkeypatch.delenv("EAGLE3_HF_API_KEY", raising=False)
    other = same_shape_other(serveable_dir, tmp_path / "other", "config")
    served = dict(identity(fingerprint), verifier=str(other), verifier_identity=teacher_hashes(str(other)))
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=4)
    recorded, found = served["verifier_identity"]["config_sha256"], teacher_hashes(str(serveable_dir))["config_sha256"]
    with Stub(serveable_model, served) as stub:
        code = main(train_args(stub.url, tmp_path / "run", "--verifier", str(serveable_dir), "--prepared-dir",
                               str(prepared)))
        assert code == 1 and stub.posts == 0
    assert errors(capsys) == [f"error: {stub.url}: features of the verifier {other}, not of --verifier {serveable_dir} "
                              f"(config_sha256 {recorded[:12]} != {found[:12]}): train with the verifier the features "
                              "were extracted from"]
