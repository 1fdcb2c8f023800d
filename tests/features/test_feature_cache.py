"""`--cache-features DIR`: the online collator keeps what the feature server sent and reads it back, and a
resumed run fetches exactly the rows it has not trained on; against the stub server of test_online_endpoint
(requests counted there, so every claim here is a number of requests)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from eagle3_hf.data.prepared_samples import PreparedDataset
from eagle3_hf.features.collator import FeatureCollator
from eagle3_hf.features.feature_cache import FeatureCache
from eagle3_hf.features.packing import PackedDataset
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.records import make_header
from eagle3_hf.features.routes.feature_server_client import FeatureClient
from eagle3_hf.features.store import merge_manifests

from tests.helpers.feature_stub import AUX, Stub, identity, offline_features, server_source
from tests.helpers.serveable import HIDDEN, LAYERS, VOCAB, serveable_verifier, walk_prepared

INFO = {"name": "stub", "revision": None, "num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "vocab_size": VOCAB}


@pytest.fixture(scope="module")
def model():
    return serveable_verifier()


def caching(url, prepared, model, fingerprint, dtype, cache_dir=None, max_seq_len=24):
    cache = None if cache_dir is None else FeatureCache(cache_dir, make_header(INFO, fingerprint, AUX, dtype,
                                                                                 source="vllm"))
    return FeatureCollator(server_source(FeatureClient(url), model, fingerprint, dtype),
                           PreparedDataset(prepared, "all", 0.2, fingerprint), cache=cache, max_seq_len=max_seq_len)


def batches(rows: PackedDataset, size: int = 2) -> list[list[dict]]:
    return [[rows[r] for r in range(i, min(i + size, len(rows)))] for i in range(0, len(rows), size)]


def assert_equal(a: dict, b: dict, where) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (where, key)


@pytest.mark.parametrize("dtype, overlong", [("bfloat16", "truncate"), ("float8_e4m3fn", "split")])
def test_epoch_two_reads_the_cache_bit_for_bit(tmp_path, model, fingerprint, dtype, overlong):
    """Epoch 1 fetches each sample once and keeps it; epoch 2 and a rerun make no request; every batch equals
    the all-online one bit for bit (split pieces included); DIR is a feature directory FeatureDataset reads."""
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=10)
    rows = PackedDataset(PreparedDataset(prepared, "all", 0.2, fingerprint), 24, overlong=overlong)
    with Stub(model, identity(fingerprint)) as stub:
        online = caching(stub.url, prepared, model, fingerprint, dtype)
        want = [online(b) for b in batches(rows)]
        assert stub.posts >= 10
        stub.posts = 0
        cached = caching(stub.url, prepared, model, fingerprint, dtype, tmp_path / "cache")
        for epoch in range(2):
            for i, b in enumerate(batches(rows)):
                assert_equal(cached(b), want[i], (epoch, i))
            assert stub.posts == (10 if epoch == 0 else 0), (epoch, stub.posts)  # a split sample: once too
            stub.posts = 0
        again = caching(stub.url, prepared, model, fingerprint, dtype, tmp_path / "cache")  # a rerun
        for i, b in enumerate(batches(rows)):
            assert_equal(again(b), want[i], ("rerun", i))
        assert stub.posts == 0
    assert overlong != "split" or rows.stats["split"] > 0
    merge_manifests(tmp_path / "cache")
    every = FeatureDataset(tmp_path / "cache", "all")  # checks every shard's sha256
    assert sorted(every.sample_ids) == sorted(PreparedDataset(prepared, "all", 0, fingerprint).sample_ids)
    offline = FeatureDataset(offline_features(model, prepared, tmp_path / "feats", fingerprint, dtype), "all")
    for sid in every.sample_ids:
        a, b = every[every.sample_ids.index(sid)], offline[offline.sample_ids.index(sid)]
        for key in ("input_ids", "loss_mask", "verifier_greedy", "aux_hidden_states", "last_hidden_state"):
            assert torch.equal(a[key], b[key]), (sid, key)  # the bytes extract --engine vllm writes


def _fill(url, prepared, fingerprint, cache_dir) -> None:
    """A training process: the whole epoch through the caching collator (killed by the test before the end)."""
    model = serveable_verifier()
    rows = PackedDataset(PreparedDataset(prepared, "all", 0.2, fingerprint), 64, packing=False)
    collate = caching(url, prepared, model, fingerprint, "bfloat16", cache_dir, max_seq_len=64)
    for b in batches(rows):
        collate(b)


def test_a_kill_leaves_dir_valid_and_the_rerun_fetches_only_the_missing(tmp_path, model, fingerprint):
    """Killed (SIGKILL) waiting for a batch, with a torn journal line and a half-written shard as a kill in the
    commit leaves them: DIR opens as a feature directory, and the rerun asks for exactly the samples not in it."""
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=12)
    cache_dir = tmp_path / "cache"
    ctx = multiprocessing.get_context("fork")
    with Stub(model, identity(fingerprint), "hang:6") as stub:  # 3 batches of 2 answered, the 4th never
        child = ctx.Process(target=_fill, args=(stub.url, prepared, fingerprint, cache_dir))
        child.start()
        deadline = time.monotonic() + 120
        while stub.posts < 8 and time.monotonic() < deadline and child.is_alive():
            time.sleep(0.05)
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        child.join()
    assert child.exitcode == -signal.SIGKILL, f"the filling process ended by itself (exit code {child.exitcode})"
    assert stub.posts >= 7, stub.posts
    journal = next(cache_dir.glob("manifest.r*.jsonl"))
    with open(journal, "ab") as f:
        f.write(b'{"shard": {"file": "shard-r000-0000')  # killed mid-append
    (cache_dir / "shard-r000-00099.safetensors.tmp").write_bytes(b"partial")
    kept = FeatureDataset(cache_dir, "all", allow_partial=True).sample_ids  # valid: journals merged, shards checked
    assert len(kept) == 6, kept
    every = PreparedDataset(prepared, "all", 0.2, fingerprint)
    tokens = {tuple(every[i]["input_ids"].tolist()): sid for i, sid in enumerate(every.sample_ids)}
    rows = PackedDataset(every, 64, packing=False)
    with Stub(model, identity(fingerprint)) as stub:
        want = [caching(stub.url, prepared, model, fingerprint, "bfloat16", max_seq_len=64)(b) for b in batches(rows)]
        stub.requested.clear()
        rerun = caching(stub.url, prepared, model, fingerprint, "bfloat16", cache_dir, max_seq_len=64)
        for i, b in enumerate(batches(rows)):
            assert_equal(rerun(b), want[i], i)
        fetched = [tokens[t] for t in stub.requested]
    assert sorted(fetched) == sorted(set(every.sample_ids) - set(kept))
    merge_manifests(cache_dir)
    assert sorted(FeatureDataset(cache_dir, "all").sample_ids) == sorted(every.sample_ids)
    assert not list(cache_dir.glob("*.tmp"))


def _collate_all(url, prepared, fingerprint, cache_dir, order, barrier) -> None:
    model = serveable_verifier()
    rows = PackedDataset(PreparedDataset(prepared, "all", 0.2, fingerprint), 64, packing=False)
    collate = caching(url, prepared, model, fingerprint, "bfloat16", cache_dir, max_seq_len=64)
    assert "none" not in collate.cache  # claims this process's journal prefix
    barrier.wait()  # both hold one before either writes
    for i in order:
        collate([rows[i]])


def test_concurrent_writers_keep_dir_valid_and_write_each_sample_once(tmp_path, model, fingerprint):
    """Two processes (DDP ranks, loader workers) filling one DIR, with the same samples wanted by both (as
    even_batches repeats them): each their own journal, each sample stored once, DIR readable."""
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=10)
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(2)
    with Stub(model, identity(fingerprint)) as stub:
        procs = [ctx.Process(target=_collate_all, args=(stub.url, prepared, fingerprint, tmp_path / "cache",
                                                         list(o), barrier)) for o in (range(10), range(9, -1, -1))]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0, 0]
    assert len(list((tmp_path / "cache").glob("manifest.r*.jsonl"))) == 2
    manifest = merge_manifests(tmp_path / "cache")  # raises on a sample stored twice
    assert len(manifest["samples"]) == 10
    assert len(FeatureDataset(tmp_path / "cache", "all")) == 10


# ---------------------------------------------------------------- the training script, against the stub


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer, fingerprint, model):
    """A verifier directory the stub serves (same weights), 12 prepared samples and a vocabulary for them."""
    from eagle3_hf.data.vocab import save_vocab, vocab_from_target_ids

    root = tmp_path_factory.mktemp("served")
    model.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    prepared = walk_prepared(root / "prepared", fingerprint, n=12)
    feats = FeatureDataset(offline_features(model, prepared, root / "feats", fingerprint, "bfloat16"), "all")
    greedy = torch.cat([feats[i]["verifier_greedy"] for i in range(len(feats))]).unique()
    save_vocab(root / "vocab.safetensors", *vocab_from_target_ids(greedy, VOCAB), fingerprint, coverage=1.0)
    return root


def train(served: Path, url: str, out: Path, *extra: str) -> list[float]:
    """The training script in this process, no packing (each row one sample, each batch 2 samples), 2 epochs
    of 6 steps at a constant learning rate; the step losses."""
    from eagle3_hf.scripts.train import main

    summary = main(["--verifier", str(served / "verifier"), "--vocab", str(served / "vocab.safetensors"),
                    "--prepared-dir", str(served / "prepared"), "--features", url, "--output-dir", str(out),
                    "--max-seq-len", "64", "--packing", "false", "--per-device-train-batch-size", "2",
                    "--learning-rate", "1e-2", "--lr-scheduler-type", "constant", "--logging-steps", "1",
                    "--eval-strategy", "no", "--save-strategy", "no", "--disable-tqdm", "true", "--seed", "7",
                    "--validation-fraction", "0", "--num-train-epochs", "2", "--report-to", "none", *extra])
    return [h["loss"] for h in summary["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def all_online(served, model, fingerprint, tmp_path_factory):
    """(losses, requests) of the uninterrupted all-online run."""
    with Stub(model, identity(fingerprint)) as stub:
        losses = train(served, stub.url, tmp_path_factory.mktemp("online") / "run")
    assert len(losses) == 12 and stub.posts == 24  # 12 samples, twice
    return losses


def test_training_with_the_cache_fetches_once_and_trains_the_same(served, model, fingerprint, all_online, tmp_path):
    cache = tmp_path / "cache"
    with Stub(model, identity(fingerprint)) as stub:
        losses = train(served, stub.url, tmp_path / "run", "--cache-features", str(cache))
        assert stub.posts == 12  # epoch 1 only
    assert losses == all_online  # bit for bit
    manifest = json.loads((cache / "manifest.json").read_text())  # merged at the end of training
    assert len(manifest["samples"]) == 12 and manifest["tokenizer_fingerprint"] == fingerprint


def test_resume_fetches_exactly_the_rows_not_trained_on(served, model, fingerprint, all_online, tmp_path):
    """Stopped after step 8 (epoch 2, step 2), resumed: the Trainer skips 2 batches of the epoch, and the server
    sees exactly the 4 remaining batches' 8 samples, each once; the losses are the uninterrupted run's."""
    with Stub(model, identity(fingerprint)) as stub:
        first = train(served, stub.url, tmp_path / "run", "--max-steps", "8", "--save-strategy", "steps",
                      "--save-steps", "8")
    assert first == all_online[:8]
    with Stub(model, identity(fingerprint)) as stub:
        rest = train(served, stub.url, tmp_path / "run", "--resume-from-checkpoint",
                     str(tmp_path / "run" / "checkpoint-8"))
        requests, distinct = len(stub.requested), len(set(stub.requested))  # counts only: no tokens in a failure
    assert (requests, distinct) == (8, 8)
    assert rest == all_online  # the checkpoint's 8 logged losses, then the 4 trained again equal


def test_a_cache_of_another_tokenizer_is_one_line_naming_dir(served, model, fingerprint, tmp_path, capsys):
    from eagle3_hf.scripts.train import run_script

    cache = tmp_path / "cache"
    FeatureCache(cache, make_header(INFO, "another-tokenizer", AUX, "bfloat16", source="vllm")).put({})
    with Stub(model, identity(fingerprint)) as stub:
        code = run_script(["--verifier", str(served / "verifier"), "--prepared-dir", str(served / "prepared"),
                           "--features", stub.url, "--cache-features", str(cache), "--output-dir",
                           str(tmp_path / "run"), "--vocab", str(served / "vocab.safetensors")])
        assert stub.posts == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: --cache-features {cache} holds features with "), err
    assert f"tokenizer_fingerprint 'another-tokenizer' (this run: {fingerprint!r})" in err[0], err
