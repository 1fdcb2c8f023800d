"""`extract --engine sglang --endpoint URL` (features/routes/sglang_server_client.py): against the answers a real
SGLang 0.5.23 gave (recorded by hand from a server on the CPU, tests/data_files/sglang/, replayed on loopback), and its
refusals against a stand-in that computes SGLang's answers with transformers (tests/helpers/sglang_stub.py)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf.errors import EndpointError
from eagle3_hf.features.interface import PreparedSample
from eagle3_hf.features.routes.sglang_server_client import SglangOptions
from eagle3_hf.features.table import SourceRequest, open_source
from eagle3_hf.publish.aux_id_rules import sglang_ids_to_send

from tests.helpers.assertions import assert_same_training
from tests.helpers.serveable import LAYERS
from tests.helpers.sglang_stub import SglangStub, load_recording

AUX = (2, 4, 5)  # the serveable verifier's default; index N-1 = 5 is among them
LLAMA_IDS = sglang_ids_to_send([2, 4, 5], "llama", LAYERS, "0.5.23")


def sample(ids: list[int], name: str = "s0") -> PreparedSample:
    return PreparedSample(name, torch.tensor(ids), torch.ones(len(ids), dtype=torch.long))


def opened(url: str, verifier: str, aux=AUX, dtype: str = "float32", **options):
    return open_source(SourceRequest("sglang-server", url, verifier, aux_indices=aux, dtype=dtype,
                                     options=SglangOptions(url, backoff_s=0.01, **options)))


# ---------------------------------------------------------------- a real SGLang's answers

@pytest.fixture(scope="module")
def recorded():
    from eagle3_hf.verifier.loading import load_verifier, resolve_verifier

    recording = load_recording()
    with SglangStub(recording=recording) as stub:  # it served --model-path smollm2-135m-instruct's directory
        yield recording, stub, "smollm2-135m-instruct", load_verifier(resolve_verifier("smollm2-135m-instruct"))


@pytest.mark.parametrize("parser", ["orjson", "json"])
def test_a_real_sglangs_states_are_transformers_states(recorded, parser, monkeypatch):
    """SGLang 0.5.23 on the CPU in fp32, SmolLM2-135M-Instruct, started with ids 1 14 26 28 (Llama reader: + 1):
    the aux states are SGLang's floats exactly as sent, and they are transformers' output_hidden_states[2, 15, 27];
    index 29 run through the last layer here, normed, is transformers' last state; the greedy tokens are
    transformers' argmax. With orjson (installed with the dev extra) and with the standard library's parser.

    On the CPU they were recorded on (an AMD EPYC) transformers computes the same floats bit for bit; another CPU's
    fp32 kernels (a Xeon with AMX) round differently, about 1e-6 of a state's size after 28 layers, so against this
    machine's transformers the states are held to fp32 accumulation (1e-4 relative), far below what another layer's
    states or an off-by-one position would differ by."""
    from eagle3_hf.features.routes import sglang_server_client

    if parser == "json":
        monkeypatch.setattr(sglang_server_client, "json_parser", lambda: ("json", json.loads))
    recording, stub, path, model = recorded
    source = opened(stub.url, path, aux=(2, 15, 27))
    assert source.client.parser == parser
    assert source.layer_ids == [1, 14, 26, 28] == sorted(recording["server_info"]["return_aux_hidden_state_layer_ids"])
    source.check([len(x["request"]["input_ids"]) for x in recording["exchanges"]])
    samples = [sample(x["request"]["input_ids"], f"r{i}") for i, x in enumerate(recording["exchanges"])]
    got = list(source.states(samples))
    assert [f.sample.sample_id for f in got] == [s.sample_id for s in samples]
    hidden = model.config.hidden_size
    for feats, exchange in zip(got, recording["exchanges"], strict=True):
        sent = torch.tensor(exchange["response"]["meta_info"]["hidden_states"][0], dtype=torch.float32)
        assert torch.equal(feats.aux_hidden_states, sent[:, :3 * hidden])  # ids 1, 14, 26: parsed without a rounding
        with torch.no_grad():
            out = model(feats.sample.input_ids[None], output_hidden_states=True)
        hs = [h[0] for h in out.hidden_states]
        torch.testing.assert_close(feats.aux_hidden_states, torch.cat([hs[2], hs[15], hs[27]], dim=-1),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(feats.last_hidden_state, hs[-1], rtol=1e-4, atol=1e-4)
        assert not torch.allclose(feats.aux_hidden_states, torch.cat([hs[3], hs[16], hs[28]], dim=-1),
                                  rtol=1e-2, atol=1e-2)  # the tolerance tells neighbouring layers apart
        assert torch.equal(feats.verifier_greedy, out.logits[0].argmax(-1))
    report = source.report()
    assert report["sglang_version"] == "0.5.23" and report["next_token_agreement"] == 1.0
    assert report["json_parser"] == parser
    assert source.identity.provenance["sglang_layer_ids"] == [1, 14, 26, 28]


def test_extract_writes_what_training_reads(recorded, tmp_path, fingerprint):
    """Through the one write loop: the manifest names the source, SGLang's version and ids; the reader reads it."""
    import datasets

    from eagle3_hf.data.prepared_samples import PreparedDataset
    from eagle3_hf.features.reader import FeatureDataset
    from eagle3_hf.features.write import write_features

    recording, stub, path, _model = recorded
    rows = [x["request"]["input_ids"] for x in recording["exchanges"]]
    prepared = tmp_path / "prepared"
    datasets.Dataset.from_dict({"id": [f"r{i}" for i in range(len(rows))], "input_ids": rows,
                                "loss_mask": [[1] * len(r) for r in rows]}).save_to_disk(str(prepared))
    (prepared / "eagle3_prepare.json").write_text(json.dumps({"tokenizer_fingerprint": fingerprint}))
    source = open_source(SourceRequest("sglang-server", stub.url, path, aux_indices=(2, 15, 27),
                                       tokenizer_fingerprint=fingerprint, options=SglangOptions(stub.url)))
    checked = PreparedDataset(prepared, "all", tokenizer_fingerprint=fingerprint)
    summary = write_features(source, checked, tmp_path / "out", progress=False)
    assert summary.written_samples == len(rows)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source"] == "sglang" and manifest["aux_layer_indices"] == [2, 15, 27]
    assert manifest["provenance"]["sglang_version"] == "0.5.23"
    data = FeatureDataset(tmp_path / "out", "all")
    assert len(data) == len(rows) and data[0]["aux_hidden_states"].shape[-1] == 3 * 576


# ---------------------------------------------------------------- refusals, one line each

@pytest.fixture
def stub_for(serveable_model, serveable_dir):
    started = []

    def start(behaviour: str = "ok", **info):
        stub = SglangStub(model=serveable_model, model_path=str(serveable_dir), layer_ids=LLAMA_IDS,
                          behaviour=behaviour, info=info).__enter__()
        started.append(stub)
        return stub

    yield start
    for stub in started:
        stub.stop()


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("info, said", [
    ({"return_aux_hidden_state_layer_ids": [2, 4, 5]},
     r"captures SGLang layer ids \[2, 4, 5\]; this extraction needs \[1, 3, 4\].*layer-ids 1 3 4"),
    ({"enable_return_aux_hidden_states": False}, "does not return aux hidden states"),
    ({"disable_radix_cache": False}, "--disable-radix-cache"),
    ({"model_path": "/models/other"}, "serves /models/other, not the verifier"),
])
def test_a_server_that_cannot_give_these_states_is_refused_before_anything_is_written(stub_for, serveable_dir,
                                                                                        info, said):
    stub = stub_for(**info)
    with pytest.raises(EndpointError, match=said) as refused:
        opened(stub.url, str(serveable_dir)).check([10])
    one_line(refused)
    assert stub.posts == 0


@pytest.mark.parametrize("behaviour, said", [
    ("short", r"sample 's0'.*\(9, 384\) states for a prompt of 10 tokens.*--disable-radix-cache"),
    ("nan", r"sample 's0'.*non-finite states in captured layers \[1\]"),
    ("fail:2", r"answered 500 for sample 's1': scheduler died"),
    ("foreign", r"differs from the verifier's greedy token .* first 2 samples \(last 's1'\)"),
])
def test_a_bad_answer_is_one_line_naming_the_sample(stub_for, serveable_dir, behaviour, said):
    stub = stub_for(behaviour)
    source = opened(stub.url, str(serveable_dir), requests=1, retries=1)
    source.check([10, 10])
    ids = list(range(1000, 1020, 2))
    with pytest.raises(EndpointError, match=said) as refused:
        list(source.states([sample(ids, "s0"), sample(ids[::-1], "s1")]))
    one_line(refused)


def test_a_dropped_connection_is_retried(stub_for, serveable_dir):
    stub = stub_for("drop:1")
    source = opened(stub.url, str(serveable_dir), requests=1)
    source.check([10])
    got = list(source.states([sample(list(range(1000, 1020, 2)))]))
    assert len(got) == 1 and stub.posts == 2


def test_the_context_bounds_the_samples(stub_for, serveable_dir):
    stub = stub_for(max_req_input_len=64)
    assert opened(stub.url, str(serveable_dir)).check([10]) == 64
    assert opened(stub.url, str(serveable_dir), max_model_len=32).check([10]) == 31
    stub = stub_for(max_req_input_len=None, context_length=48)  # no longest prompt named: its context less one
    assert opened(stub.url, str(serveable_dir)).check([10]) == 47


def test_no_server_is_one_line():
    with pytest.raises(EndpointError, match="no SGLang server answers at http://127.0.0.1:9") as refused:
        opened("http://127.0.0.1:9", "smollm2-135m-instruct", retries=0)
    one_line(refused)


def test_extract_engine_sglang_needs_an_endpoint(tmp_path, capsys):
    from eagle3_hf.cli import main

    assert main(["extract", "--engine", "sglang", "--data", str(tmp_path), "--output", str(tmp_path / "o")]) == 1
    assert "--engine sglang needs --endpoint URL" in capsys.readouterr().err


# ---------------------------------------------------------------- online: train --features sglang:URL

def test_the_features_syntax_names_sglang():
    from eagle3_hf.features.table import FeatureSpec

    spec = FeatureSpec.parse("sglang:http://127.0.0.1:31000/")
    assert (spec.kind, spec.target, spec.online, spec.remote) == ("sglang-server", "http://127.0.0.1:31000", True,
                                                                  True)
    with pytest.raises(ValueError, match="sglang:http://HOST:PORT"):
        FeatureSpec.parse("sglang:127.0.0.1:31000")


def test_training_online_from_sglang_equals_training_on_its_extraction(stub_for, serveable_dir, tokenizer,
                                                                       fingerprint, tmp_path):
    """The same steps trained on `extract --engine sglang`'s shards and online from the same server, with no
    --verifier (the server's --model-path names it): equal losses and equal weights, bit for bit."""
    from eagle3_hf.data.prepared_samples import PreparedDataset
    from eagle3_hf.data.vocab import save_vocab, vocab_from_target_ids
    from eagle3_hf.features.reader import FeatureDataset
    from eagle3_hf.features.write import write_features
    from eagle3_hf.scripts.train import run_script

    from tests.helpers.serveable import VOCAB, walk_prepared

    stub = stub_for()
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=10)
    source = open_source(SourceRequest("sglang-server", stub.url, str(serveable_dir), dtype="bfloat16",
                                       tokenizer_fingerprint=fingerprint, options=SglangOptions(stub.url)))
    checked = PreparedDataset(prepared, "all", tokenizer_fingerprint=fingerprint)
    write_features(source, checked, tmp_path / "feats", progress=False)
    every = FeatureDataset(tmp_path / "feats", split="all")
    greedy = torch.cat([every[i]["verifier_greedy"] for i in range(len(every))]).unique()
    save_vocab(tmp_path / "vocab.safetensors", *vocab_from_target_ids(greedy, VOCAB), fingerprint, coverage=1.0)
    common = ["--vocab", str(tmp_path / "vocab.safetensors"), "--max-steps", "3", "--logging-steps", "1",
              "--save-strategy", "no", "--eval-strategy", "no", "--max-seq-len", "48", "--learning-rate", "1e-2",
              "--disable-tqdm", "true", "--seed", "7", "--validation-fraction", "0.2",
              "--dataloader-num-workers", "0"]
    assert run_script(common + ["--features", str(tmp_path / "feats"), "--output-dir", str(tmp_path / "off")]) == 0
    posts = stub.posts
    assert run_script(common + ["--features", f"sglang:{stub.url}", "--prepared-dir", str(prepared),
                                "--output-dir", str(tmp_path / "on")]) == 0
    assert stub.posts > posts
    assert_same_training(tmp_path / "off", tmp_path / "on", steps=3)


def test_training_online_from_sglang_serving_another_model_is_one_line(stub_for, tmp_path, fingerprint, capsys,
                                                                       tiny_verifier_dir):
    from eagle3_hf.scripts.train import run_script

    from tests.helpers.serveable import walk_prepared

    stub = stub_for(model_path="/models/other")
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=4)
    capsys.readouterr()
    code = run_script(["--verifier", str(tiny_verifier_dir), "--features", f"sglang:{stub.url}", "--prepared-dir",
                       str(prepared), "--output-dir", str(tmp_path / "run"), "--max-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and "serves /models/other" in err[0], err
    assert stub.posts == 0
