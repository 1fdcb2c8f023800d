"""`regenerate --features-out`: the answers of plain `regenerate`, the features of `extract` within float rounding,
the prepared dataset of `prepare` on the same tokens, and a SIGKILLed run resumes with nothing lost or duplicated.

Tolerance: a KV-cached, left-padded batched pass and extract's unpadded full forward
run the same fp32 math in different kernel shapes; per token, ||a - b|| / ||a|| <= 1e-5 in fp32 storage, and in
bf16 storage the two roundings of the same value differ by at most one bf16 step (relative error <= 2^-7).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch

from eagle3_hf.data.conversations import write_jsonl
from eagle3_hf.data.fingerprint import tokenizer_fingerprint
from eagle3_hf.data.prepare import prepare_conversations
from eagle3_hf.data.regenerate import RegenerateOutputs, regenerate
from eagle3_hf.data.regenerate_backends import TransformersBackend
from eagle3_hf.evaluation.feature_diff import diff_features
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.routes.transformers import extract_features
from eagle3_hf.features.transformers_generation import regenerate_with_features
from eagle3_hf.features.write import StoreOptions

from tests.helpers.data import kill_after_shards, rows  # rows: JSONL rows by id, refusing duplicates

ROOT = Path(__file__).resolve().parents[2]


def U(text):
    return {"role": "user", "content": text}


CONVS = [
    {"id": "multi", "messages": [{"role": "system", "content": "Be brief."}, U("u1"),
                                 {"role": "assistant", "content": "x"},
                                 U("u2 is longer than the others, by a few words")]},
    {"id": "single", "messages": [U("only question")]},
] + [{"id": f"c{i}", "messages": [U(f"question number {i} " * (1 + i % 3))]} for i in range(5)]


@pytest.fixture(scope="module")
def backend(tiny_verifier_dir):
    return TransformersBackend(str(tiny_verifier_dir), device="cpu", max_new_tokens=6)


def _extract(backend, prepared, out, dtype):
    fp = tokenizer_fingerprint(backend.tokenizer)
    extract_features(backend.model, fp, prepared, out, dtype=dtype, verifier_name=backend.name, progress=False)


def test_features_equal_extract_and_answers_equal_regenerate(tmp_path, backend):
    outputs = RegenerateOutputs(tmp_path / "c.jsonl", tmp_path / "f32", tmp_path / "prep")
    stats = regenerate_with_features(CONVS, outputs, backend, batch_size=3, dtype="fp32", store=StoreOptions(2),
                                     progress=False)
    assert stats.route["conversations"] == len(CONVS) and stats.route["generated"] > 0
    assert stats.written_samples == stats.total_samples == len(CONVS) and stats.skipped == {}
    # the answers are those of plain `regenerate` (HF generate, greedy)
    regenerate(CONVS, tmp_path / "plain.jsonl", backend, batch_size=3, progress=False)
    ours, plain = rows(tmp_path / "c.jsonl"), rows(tmp_path / "plain.jsonl")
    assert {k: v["messages"] for k, v in ours.items()} == {k: v["messages"] for k, v in plain.items()}
    assert {k: v["regenerated"] for k, v in ours.items()} == {k: v["regenerated"] for k, v in plain.items()}

    # the features are extract's on the same tokens, within rounding (fp32 storage)
    _extract(backend, tmp_path / "prep", tmp_path / "x32", "fp32")
    report = diff_features(tmp_path / "x32", tmp_path / "f32")
    assert report["samples_compared"] == len(CONVS) and report["token_mismatch"] == 0 and not report["warnings"]
    assert all(s["rel_err_max"] <= 1e-5 for s in report["layers"].values()), report["layers"]
    assert report["greedy_agreement"] == 1.0
    # bf16 storage: at most one bf16 step apart
    regenerate_with_features(CONVS, RegenerateOutputs(tmp_path / "c16.jsonl", tmp_path / "bf16"), backend, batch_size=3,
                             progress=False)
    _extract(backend, tmp_path / "prep", tmp_path / "x16", "bf16")
    report = diff_features(tmp_path / "x16", tmp_path / "bf16")
    assert report["samples_compared"] == len(CONVS) and report["token_mismatch"] == 0
    assert all(s["rel_err_max"] <= 2 ** -7 for s in report["layers"].values()), report["layers"]

    # the prepared dataset: prepare's tokens and mask on the prompt, then the generated answer and the
    # template's tail (`<|im_end|>` with loss, the newline after it without)
    tok = backend.tokenizer
    ref = {r["id"]: r for r in prepare_conversations(list(ours.values()), tok)}
    mine = datasets.load_from_disk(str(tmp_path / "prep"))
    assert mine["id"] == [c["id"] for c in CONVS]
    features = FeatureDataset(tmp_path / "f32", split="all")
    end, newline = tok.convert_tokens_to_ids("<|im_end|>"), tok("\n", add_special_tokens=False)["input_ids"]
    for row in mine:
        prompt = tok.apply_chat_template(ours[row["id"]]["messages"][:-1], add_generation_prompt=True)
        prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        n = len(prompt)
        assert row["input_ids"][:n] == list(prompt)  # what the verifier was asked with
        # prepare tokenizes prompt and answer text together: the header's last token may merge with the start
        # of an answer (the tiny verifier's random answers often begin with whitespace)
        assert row["input_ids"][:n - 1] == ref[row["id"]]["input_ids"][:n - 1]
        assert row["loss_mask"][:n - 1] == ref[row["id"]]["loss_mask"][:n - 1]
        assert (sum(row["loss_mask"][:n]) > 0) == (row["id"] == "multi")  # an earlier assistant turn has loss
        assert row["input_ids"][-2:] == [end, *newline]
        assert row["loss_mask"][n:] == [1] * (len(row["loss_mask"]) - n - 1) + [0]
        sample = features[features.sample_ids.index(row["id"])]
        assert sample["input_ids"].tolist() == row["input_ids"]
        assert sample["loss_mask"].long().tolist() == row["loss_mask"]


_CHILD = r"""
import sys, time, torch
torch.set_num_threads(1)
from eagle3_hf.data.conversations import load_conversations
from eagle3_hf.data.regenerate import RegenerateOutputs
from eagle3_hf.data.regenerate_backends import TransformersBackend
from eagle3_hf.features.transformers_generation import regenerate_with_features
from eagle3_hf.features.write import StoreOptions
verifier_dir, src, out, feats = sys.argv[1:5]
backend = TransformersBackend(verifier_dir, device="cpu", max_new_tokens=6)
backend.model.model.layers[0].register_forward_pre_hook(lambda *a: time.sleep(0.05))
regenerate_with_features(load_conversations(src), RegenerateOutputs(out, feats), backend, batch_size=2,
                         store=StoreOptions(1), progress=False)
"""


def test_sigkill_and_resume(tmp_path, tiny_verifier_dir, backend):
    convs = [{"id": f"k{i:02d}", "messages": [U(f"question {i} " * (1 + i % 4))]} for i in range(12)]
    write_jsonl(tmp_path / "in.jsonl", convs)
    out, feats = tmp_path / "c.jsonl", tmp_path / "f"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(tiny_verifier_dir), str(tmp_path / "in.jsonl"),
                             str(out), str(feats)], env=env)
    kill_after_shards(proc, feats / "manifest.r000.jsonl", 3, timeout=180)
    partial = FeatureDataset(feats, split="all", allow_partial=True)
    assert 3 <= len(partial) < 12
    assert not out.exists() or len(rows(out)) <= len(partial)  # answers reach OUTPUT only with their shard
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stats = regenerate_with_features(convs, RegenerateOutputs(out, feats), backend, batch_size=2,
                                         store=StoreOptions(1), progress=False)
        full = regenerate_with_features(convs, RegenerateOutputs(tmp_path / "u.jsonl", tmp_path / "u"), backend,
                                        batch_size=2, store=StoreOptions(1), progress=False)
    finally:
        torch.set_num_threads(threads)
    assert stats.resumed_past >= len(partial) and stats.resumed_past + stats.route["conversations"] == 12
    assert full.route["conversations"] == 12
    resumed = rows(out)  # no duplicate ids
    assert sorted(resumed) == [c["id"] for c in convs] == sorted(FeatureDataset(feats, split="all").sample_ids)
    uninterrupted = rows(tmp_path / "u.jsonl")
    assert {k: v["messages"] for k, v in resumed.items()} == {k: v["messages"] for k, v in uninterrupted.items()}
    report = diff_features(tmp_path / "u", feats)
    assert report["samples_compared"] == 12 and report["token_mismatch"] == 0
    assert all(s["rel_err_max"] <= 2 ** -7 for s in report["layers"].values())
    assert not list(tmp_path.glob("c.jsonl.r*.pending"))


def test_cli(tmp_path, tiny_verifier_dir, backend):
    from eagle3_hf.cli import main

    write_jsonl(tmp_path / "in.jsonl", CONVS)
    argv = ["regenerate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "c.jsonl"), "--verifier",
            str(tiny_verifier_dir), "--max-new-tokens", "6", "--batch-size", "2", "--features-out", str(tmp_path / "f"),
            "--prepared-out", str(tmp_path / "prep"), "--features-dtype", "fp8", "--max-seq-len", "40"]
    assert main(argv) == 0
    ds = FeatureDataset(tmp_path / "f", split="all")
    assert ds.manifest["dtype"] == "float8_e4m3fn" and max(ds.lengths) == 40
    # truncated to 40 tokens; a prompt of 40 or more leaves no loss token: refused by id, like extract's refusals
    refused = ds.manifest["skipped_ids"]["no_loss_tokens"]
    assert refused
    assert sorted(ds.sample_ids + refused) == sorted(c["id"] for c in CONVS) == sorted(rows(tmp_path / "c.jsonl"))
    prepared = datasets.load_from_disk(str(tmp_path / "prep"))
    assert prepared["id"] == [c["id"] for c in CONVS if c["id"] not in refused]
    meta = json.loads((tmp_path / "prep" / "eagle3_prepare.json").read_text())
    assert meta["counts"]["skipped"] == {"no_loss_tokens": len(refused)} and meta["counts"]["samples"] == len(prepared)
    assert main(argv) == 0  # nothing left to do: no sample duplicated
    assert len(FeatureDataset(tmp_path / "f", split="all")) == len(ds) and len(rows(tmp_path / "c.jsonl")) == len(CONVS)
    regenerate(CONVS[:1], tmp_path / "plain.jsonl", backend, progress=False)
    with pytest.raises(ValueError, match="have no features"):  # a plain regenerate output is not taken for done
        regenerate_with_features(CONVS, RegenerateOutputs(tmp_path / "plain.jsonl", tmp_path / "g"), backend,
                                 progress=False)


def test_two_workers_share_the_batches(tmp_path, tiny_verifier_dir):
    """This process is slowed down (0.3 s per forward): the spawned worker takes batches once it is up."""
    slow = TransformersBackend(str(tiny_verifier_dir), device="cpu", max_new_tokens=6)
    slow.model.model.layers[0].register_forward_pre_hook(lambda *a: time.sleep(0.3))
    convs = CONVS + [{"id": f"d{i}", "messages": [U(f"more {i}")]} for i in range(5)]
    stats = regenerate_with_features(convs, RegenerateOutputs(tmp_path / "c.jsonl", tmp_path / "f"), slow,
                                     num_workers=2, batch_size=1, store=StoreOptions(1), progress=False)
    assert stats.route["conversations"] == len(convs) == stats.written_samples == stats.total_samples
    ds = FeatureDataset(tmp_path / "f", split="all")
    shards = [s["file"] for s in ds.manifest["shards"]]
    assert any("-r000-" in s for s in shards) and any("-r001-" in s for s in shards)
    assert sorted(ds.sample_ids) == sorted(c["id"] for c in convs) == sorted(rows(tmp_path / "c.jsonl"))
    one = TransformersBackend(str(tiny_verifier_dir), device="cpu", max_new_tokens=6)
    regenerate_with_features(convs, RegenerateOutputs(tmp_path / "one.jsonl", tmp_path / "one"), one, batch_size=1,
                             progress=False)
    report = diff_features(tmp_path / "one", tmp_path / "f")
    assert report["samples_compared"] == len(convs) and report["token_mismatch"] == 0
    assert all(s["rel_err_max"] <= 2 ** -7 for s in report["layers"].values())


def test_a_slow_remote_code_tokenizer_writes_the_fast_tokenizers_samples(tmp_path, tiny_verifier_dir,
                                                                         slow_remote_tokenizer_dir, capsys):
    """`regenerate --features-out --trust-remote-code` with a slow tokenizer shipped as remote code (no offsets: the
    prompt's earlier turns and the template's tail are masked by encoding) writes the samples, masks and prepared
    dataset the fast tokenizer of the same vocabulary writes."""
    from eagle3_hf.cli import main
    from eagle3_hf.verifier import remote_code

    convs = CONVS[:1] + [{"id": "three", "messages": [U("a"), {"role": "assistant", "content": "b"}, U("c")]}]
    write_jsonl(tmp_path / "in.jsonl", convs)
    try:
        for name, verifier, trust in (("fast", tiny_verifier_dir, []),
                                      ("slow", slow_remote_tokenizer_dir, ["--trust-remote-code"])):
            assert main(["regenerate", "--input", str(tmp_path / "in.jsonl"), "--output",
                         str(tmp_path / f"{name}.jsonl"), "--verifier", str(verifier), "--max-new-tokens", "4",
                         "--features-out", str(tmp_path / name), "--prepared-out", str(tmp_path / f"{name}-prep"),
                         "--features-dtype", "fp32", *trust]) == 0
    finally:
        remote_code.set_trusted(False)
    assert "Traceback" not in capsys.readouterr().err
    fast, slow = (datasets.load_from_disk(str(tmp_path / f"{n}-prep")) for n in ("fast", "slow"))
    assert len(fast) == len(convs) and slow.to_dict() == fast.to_dict()
    mask = fast["loss_mask"][fast["id"].index("three")]
    assert sum(a == 0 and b == 1 for a, b in zip([0] + mask, mask)) == 2  # both answered turns carry loss
    manifest = json.loads((tmp_path / "slow" / "manifest.json").read_text())
    assert (manifest["tokenizer_class"], manifest["trust_remote_code"]) == ("SlowByteLevelBPETokenizer", True)
