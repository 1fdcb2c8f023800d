"""`--features`: the feature client against a stub server (fast), and (slow, vLLM's CPU build) the real
feature server trained on online against the same steps offline.

The stub answers like vllm_feature_server.py: GET /identity, POST /features with the safetensors bytes of
{hidden_states [T, layers, H], token_ids [T]}, here computed by transformers in vLLM's layout (aux ids as
output_hidden_states, id N before the final norm). The slow test needs `make vllm`; without the vLLM venv it
is skipped, saying so (EAGLE3_HF_SKIP_VLLM=1 skips it too)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from eagle3_hf.data.prepared_samples import PreparedDataset
from eagle3_hf.errors import worker_message
from eagle3_hf.features.collator import FeatureCollator
from eagle3_hf.features.packing import PackedCollator, PackedDataset
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.routes.feature_server_client import FeatureClient, FeatureServerError

from tests.helpers.assertions import assert_same_training
from tests.helpers.feature_stub import LAYER_IDS, Stub, identity, offline_features, server_source, vllm_layout
from tests.helpers.serveable import HIDDEN, LAYERS, VOCAB, serveable_verifier, walk_prepared
from tests.helpers.vllm import vllm_or_fail

ROOT = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def model():
    return serveable_verifier()


@pytest.fixture
def prepared(tmp_path, fingerprint):
    return walk_prepared(tmp_path / "prepared", fingerprint, n=10)


def collator(client, prepared, model, fingerprint, dtype, max_seq_len):
    return FeatureCollator(server_source(client, model, fingerprint, dtype),
                           PreparedDataset(prepared, "all", 0.2, fingerprint), max_seq_len=max_seq_len)


@pytest.mark.parametrize("dtype, overlong", [("bfloat16", "truncate"), ("float8_e4m3fn", "split")])
def test_online_batches_equal_offline_bit_for_bit(tmp_path, model, prepared, fingerprint, dtype, overlong):
    """The same split, packing plan and rounding: every batch equal to offline's, every key, every bit (split
    pieces included); with another rounding, not equal (the rounding is applied, not skipped)."""
    offline = offline_features(model, prepared, tmp_path / "feats", fingerprint, dtype)
    max_seq_len = 24
    with Stub(model, identity(fingerprint)) as stub:
        client = FeatureClient(stub.url)
        client.check(identity(fingerprint))
        online = collator(client, prepared, model, fingerprint, dtype, max_seq_len)
        exact = collator(client, prepared, model, fingerprint, "float32", max_seq_len)
        for split in ("train", "validation"):
            a = PackedDataset(FeatureDataset(offline, split, 0.2), max_seq_len, overlong=overlong)
            b = PackedDataset(PreparedDataset(prepared, split, 0.2, fingerprint), max_seq_len, overlong=overlong)
            assert a.rows == b.rows and len(a) > 0
            for r in range(0, len(a), 2):
                want = PackedCollator(max_seq_len=max_seq_len)([a[r], a[r + 1]] if r + 1 < len(a) else [a[r]])
                rows = [b[r], b[r + 1]] if r + 1 < len(b) else [b[r]]
                got = online(rows)
                assert sorted(got) == sorted(want)
                for key in want:
                    assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (split, r, key)
                assert not torch.equal(exact(rows)["aux_hidden_states"], want["aux_hidden_states"])
        assert stub.posts > 0


def test_a_server_for_another_verifier_is_refused_before_the_first_step(tmp_path, prepared, fingerprint, capsys,
                                                                         tiny_verifier_dir):
    """The training script, pointed at a server whose hidden size differs from --verifier's: one line, no step."""
    from eagle3_hf.scripts.train import run_script

    with Stub(None, identity(fingerprint, hidden=HIDDEN)) as stub:  # tiny_verifier_dir has hidden 64
        code = run_script(["--verifier", str(tiny_verifier_dir), "--features", stub.url, "--prepared-dir",
                           str(prepared), "--output-dir", str(tmp_path / "run"), "--max-steps", "1"])
        assert stub.posts == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: feature server {stub.url} serves verifier 'stub' with hidden_size 128 "
                             f"(training: 64, {tiny_verifier_dir})"), err
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_another_tokenizer_is_refused():
    with Stub(None, identity("other")) as stub:
        with pytest.raises(FeatureServerError, match=r"tokenizer_fingerprint 'other' \(training: 'fp'"):
            FeatureClient(stub.url).check({"hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                                           "tokenizer_fingerprint": "fp"})


def test_an_unreachable_server_is_one_line(tmp_path, prepared, capsys, tiny_verifier_dir):
    import socket

    from eagle3_hf.scripts.train import run_script

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = run_script(["--verifier", str(tiny_verifier_dir), "--features", f"http://127.0.0.1:{port}",
                       "--prepared-dir", str(prepared), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: feature server http://127.0.0.1:{port} unreachable (")
    assert "eagle3-hf serve-features" in err[0]


def test_a_request_that_times_out_is_retried_then_one_line_naming_the_sample(model, fingerprint):
    with Stub(model, identity(fingerprint), "slow") as stub:
        client = FeatureClient(stub.url, timeout=0.5, retries=2, backoff_s=0.01)
        start = time.monotonic()
        with pytest.raises(FeatureServerError) as err:
            client.states([1000, 1002, 1004], "w007")
        assert stub.posts == 3 and time.monotonic() - start < 10
    text = str(err.value)
    assert text == (f"feature server {stub.url}: sample 'w007' failed 3 times (timed out; --online-timeout 0.5 s)")


def test_a_restarting_server_is_retried_and_the_batch_still_equal(model, prepared, fingerprint):
    with Stub(model, identity(fingerprint), "down:2") as stub:
        client = FeatureClient(stub.url, retries=3, backoff_s=0.01)
        client.check(identity(fingerprint))
        got = client.states([1000, 1002, 1004], "w000")
        assert stub.posts == 3
        assert torch.equal(got["hidden_states"], vllm_layout(model, torch.tensor([1000, 1002, 1004])))
    with Stub(model, identity(fingerprint), "down:9") as stub:
        with pytest.raises(FeatureServerError, match=r"sample 'w000' failed 2 times \(restarting\)"):
            FeatureClient(stub.url, retries=1, backoff_s=0.01).states([1000], "w000")


def test_non_finite_states_are_refused_naming_the_sample(model, prepared, fingerprint):
    every = PreparedDataset(prepared, "all", 0.2, fingerprint)
    first = int(every[3]["input_ids"][0])
    with Stub(model, identity(fingerprint), f"nan:{first}") as stub:
        online = collator(FeatureClient(stub.url), prepared, model, fingerprint, "bfloat16", 64)
        rows = PackedDataset(every, 64, packing=False)
        bad = next(r for r in range(len(rows)) if rows[r]["pieces"][0][0] == every.sample_ids[3])
        with pytest.raises(ValueError, match=rf"non-finite hidden states for sample '{every.sample_ids[3]}' at vLLM "
                                             rf"layer ids \[{LAYER_IDS[1]}\]"):
            online([rows[bad]])


def test_a_worker_error_is_its_own_line():
    wrapped = ("Caught FeatureServerError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
               "last):\n  File \"x.py\", line 1, in f\n    raise X\n"
               "eagle3_hf.features.routes.feature_server_client.FeatureServerError:"
               " feature server http://h:1: sample 'a' failed 4 times (timed out)\n")
    assert worker_message(wrapped) == "feature server http://h:1: sample 'a' failed 4 times (timed out)"
    assert worker_message("plain message") == "plain message"


# ---------------------------------------------------------------- slow: vLLM's feature server, trained on


def serving(storage: Path) -> bool:
    """Whether a feature server's storage directory belongs to a server still running (its `pid` file)."""
    try:
        os.kill(int((storage / "pid").read_text().strip()), 0)
    except (OSError, ValueError):  # no pid file, or no such process
        return False
    return True


def _train(args: list[str], processes: int, env: dict) -> subprocess.CompletedProcess:
    launch = [sys.executable, str(ROOT / "examples" / "train.py")] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
        str(29600 + os.getpid() % 300), str(ROOT / "examples" / "train.py")]
    return subprocess.run(launch + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_training_online_from_the_vllm_server_equals_offline(tmp_path, tokenizer, fingerprint):
    """extract --engine vllm, then the same steps trained offline and online (2 processes over gloo, one
    server): equal losses and equal weights, bit for bit at the same bf16 rounding; no feature file left."""
    from eagle3_hf.data.vocab import save_vocab, vocab_from_target_ids
    from eagle3_hf.features.commands.serve_features import ServerSettings, start_feature_server
    from eagle3_hf.features.vllm.vllm_spec import VllmOptions

    vllm_or_fail()
    verifier = serveable_verifier()
    vdir = tmp_path / "verifier"
    verifier.save_pretrained(vdir)
    tokenizer.save_pretrained(vdir)
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=16)
    feats = tmp_path / "feats"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([str(Path(sys.executable).parent / "eagle3-hf"), "extract", "--engine", "vllm",
                           "--verifier", str(vdir), "--data", str(prepared), "--output", str(feats),
                           "--vllm-batch-size", "4", "--no-progress"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    every = FeatureDataset(feats, split="all")
    d2t, t2d = vocab_from_target_ids(torch.cat([every[i]["verifier_greedy"] for i in range(len(every))]).unique(),
                                     VOCAB)
    save_vocab(tmp_path / "vocab.safetensors", d2t, t2d, fingerprint, coverage=1.0)
    common = ["--verifier", str(vdir), "--vocab", str(tmp_path / "vocab.safetensors"), "--max-steps", "4",
              "--logging-steps", "1", "--save-strategy", "no", "--eval-strategy", "no", "--max-seq-len", "64",
              "--per-device-train-batch-size", "1", "--learning-rate", "1e-2", "--disable-tqdm", "true",
              "--seed", "7", "--validation-fraction", "0.2"]
    off = _train(common + ["--features", str(feats), "--output-dir", str(tmp_path / "off")], 2, env)
    assert off.returncode == 0, off.stdout[-3000:] + off.stderr[-3000:]
    before = set(Path(tempfile.gettempdir()).glob("eagle3_feature_server_*"))
    with start_feature_server(ServerSettings(str(vdir), vllm=VllmOptions(max_model_len=128, timeout=600))) as server:
        assert server.identity["layer_ids"] == every.manifest["provenance"]["vllm_layer_ids"]
        on = _train(common + ["--features", server.url, "--prepared-dir", str(prepared),
                              "--output-dir", str(tmp_path / "on")], 2, env)
        assert on.returncode == 0, on.stdout[-3000:] + on.stderr[-3000:]
        left = [p for p in Path(server.storage).rglob("*") if p.name != "pid"]
        assert not left, left  # each file deleted once read
        storage = Path(server.storage)
    assert not storage.exists()
    # nothing left behind: a new directory is another worker's server, still running (pytest-xdist), or none
    new = set(Path(tempfile.gettempdir()).glob("eagle3_feature_server_*")) - before
    assert all(serving(d) for d in new), new
    assert_same_training(tmp_path / "off", tmp_path / "on", steps=4)

