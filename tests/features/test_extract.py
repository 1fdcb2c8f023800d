"""Extraction: features equal the verifier's, NaN skipped and counted, mismatched appends refused, a SIGKILLed
run resumes bit-identically, and ranks split the work and merge one manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from eagle3_hf.data.prepared_samples import PreparedDataset
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.routes.transformers import TransformersFeatures, extract_features
from eagle3_hf.features.verify import STAMP
from eagle3_hf.features.write import StoreOptions, write_features
from eagle3_hf.verifier.capture import capture_features

from tests.helpers.data import extract_in_process, kill_after_shards, make_prepared, manifest_without_stat
from tests.helpers.verifiers import make_tiny_verifier

ROOT = Path(__file__).resolve().parents[2]
V = 2048  # a small vocabulary: the LM head dominates a tiny verifier's compute


@pytest.fixture(scope="module")
def verifier():
    return make_tiny_verifier(vocab_size=V, num_layers=6)


def test_features_equal_capture(tmp_path, verifier, fingerprint):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=10, vocab=V)
    summary = extract_features(verifier, fingerprint, prepared, tmp_path / "f32", dtype="float32",
                               store=StoreOptions(4), progress=False)
    assert summary.written_samples == 10 and summary.total_samples == 10
    extract_features(verifier, fingerprint, prepared, tmp_path / "bf16", store=StoreOptions(5), progress=False)
    rows = datasets.load_from_disk(str(prepared)).with_format("torch")
    f32 = FeatureDataset(tmp_path / "f32", split="all")
    bf16 = FeatureDataset(tmp_path / "bf16", split="all")
    assert f32.manifest["aux_layer_indices"] == [2, 4, 5] and bf16.manifest["dtype"] == "bfloat16"
    assert len(f32.manifest["shards"]) == 3 and f32.lengths == [len(r["input_ids"]) for r in rows]
    for i in range(10):
        ref = capture_features(verifier, rows[i]["input_ids"].long(), (2, 4, 5))
        a, b = f32[i], bf16[i]
        assert a["sample_id"] == rows[i]["id"]
        assert torch.equal(a["input_ids"], rows[i]["input_ids"].long())
        assert torch.equal(a["loss_mask"], rows[i]["loss_mask"].bool())
        assert torch.equal(a["aux_hidden_states"], ref["aux_hidden_states"])
        assert torch.equal(a["last_hidden_state"], ref["last_hidden_state"])
        assert torch.equal(a["verifier_greedy"], ref["verifier_greedy"])
        assert torch.equal(b["aux_hidden_states"], ref["aux_hidden_states"].bfloat16().float())
        assert torch.equal(b["verifier_greedy"], ref["verifier_greedy"])


def test_nan_sample_skipped_and_counted(tmp_path, fingerprint):
    model = make_tiny_verifier(vocab_size=V, num_layers=6)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=6, vocab=V)
    rows = datasets.load_from_disk(str(prepared))
    bad = rows[2]["input_ids"][1]
    assert all(bad not in rows[i]["input_ids"] for i in range(6) if i != 2)
    with torch.no_grad():
        model.model.embed_tokens.weight[bad] = float("nan")
    summary = extract_features(model, fingerprint, prepared, tmp_path / "out", store=StoreOptions(2), progress=False)
    assert summary.skipped == {"nan_or_inf": 1} and summary.total_skipped == {"nan_or_inf": 1}
    ds = FeatureDataset(tmp_path / "out", split="all")
    assert ds.sample_ids == ["s000", "s001", "s003", "s004", "s005"]
    assert ds.manifest["skipped_ids"] == {"nan_or_inf": ["s002"]}
    # a re-run does not retry or double count it
    again = extract_features(model, fingerprint, prepared, tmp_path / "out", progress=False)
    assert again.written_samples == 0 and again.total_skipped == {"nan_or_inf": 1}


def test_mismatched_append_refused(tmp_path, verifier, fingerprint):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=4, vocab=V)
    out = tmp_path / "out"
    extract_features(verifier, fingerprint, prepared, out, progress=False, verifier_name="tiny")
    with pytest.raises(ValueError, match="aux_layer_indices"):
        extract_features(verifier, fingerprint, prepared, out, aux_indices=(1, 2, 3), progress=False,
                         verifier_name="tiny")
    with pytest.raises(ValueError, match="dtype"):
        extract_features(verifier, fingerprint, prepared, out, dtype="fp8", progress=False, verifier_name="tiny")
    with pytest.raises(ValueError, match="verifier"):
        extract_features(make_tiny_verifier(vocab_size=V, hidden_size=32, num_layers=6), fingerprint, prepared,
                         out, progress=False, verifier_name="tiny")
    other = make_prepared(tmp_path / "prep2", "0123456789abcdef", n=4, vocab=V)
    with pytest.raises(ValueError, match="tokenizer_fingerprint"):
        extract_features(verifier, "0123456789abcdef", other, out, progress=False, verifier_name="tiny")
    with pytest.raises(ValueError, match="re-run `eagle3-hf prepare`"):
        extract_features(verifier, fingerprint, other, tmp_path / "out2", progress=False)
    # the same settings append (nothing new to do here) without complaint
    assert extract_features(verifier, fingerprint, prepared, out, progress=False,
                            verifier_name="tiny").total_samples == 4


def test_write_features_refuses_samples_not_checked_against_its_route_s_tokenizer(tmp_path, verifier, fingerprint):
    """Opened for the route's tokenizer, samples another tokenizer prepared are refused at open, before any model
    loads; opened without it (as training may open them), the write loop refuses them before writing anything."""
    other = make_prepared(tmp_path / "prep", "0123456789abcdef", n=3, vocab=V)
    with pytest.raises(ValueError, match="prepared with tokenizer 0123456789abcdef"):
        PreparedDataset(other, "all", tokenizer_fingerprint=fingerprint)
    source = TransformersFeatures(verifier, fingerprint)
    for unchecked in (PreparedDataset(other, "all"), PreparedDataset(other, "all", 0.05, "0123456789abcdef")):
        with pytest.raises(ValueError, match=f"opened for tokenizer .*, but the route's tokenizer is {fingerprint}"):
            write_features(source, unchecked, tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()  # refused before anything is written
    same = PreparedDataset(make_prepared(tmp_path / "prep2", fingerprint, n=3, vocab=V), "all",
                           tokenizer_fingerprint=fingerprint)
    assert write_features(source, same, tmp_path / "written", progress=False).total_samples == 3


_CHILD = r"""
import sys, time, torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from eagle3_hf.features.routes.transformers import extract_features
from eagle3_hf.features.write import StoreOptions
verifier_dir, prepared, out, fingerprint, delay = sys.argv[1:6]
model = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype="float32").eval()
if float(delay) > 0:
    model.model.layers[0].register_forward_pre_hook(lambda *a: time.sleep(float(delay)))
extract_features(model, fingerprint, prepared, out, store=StoreOptions(2), progress=False)
"""


def _run_child(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", _CHILD, *map(str, args)], env=env, **kw)


def test_sigkill_resume_bit_identical(tmp_path, tiny_verifier_dir, fingerprint):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=16)
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = _run_child([tiny_verifier_dir, prepared, killed, fingerprint, 0.15])
    extract_in_process(tiny_verifier_dir, prepared, full, fingerprint)  # meanwhile, the uninterrupted run
    kill_after_shards(proc, killed / "manifest.r000.jsonl", 3, timeout=120)
    assert not (killed / "manifest.json").exists()
    partial = FeatureDataset(killed, split="all", allow_partial=True)  # the journal alone: readable, consistent
    assert 6 <= len(partial) < 16
    extract_in_process(tiny_verifier_dir, prepared, killed, fingerprint)
    names = sorted(p.name for p in full.iterdir())
    assert names == sorted(p.name for p in killed.iterdir() if p.name != STAMP)  # the reader's record aside
    for name in names:
        if name.endswith(".jsonl"):  # the journal differs only in how the work was cut into runs
            continue
        if name == "manifest.json":  # equal but for each shard file's own stat, taken when it was written
            assert manifest_without_stat(full / name) == manifest_without_stat(killed / name)
            continue
        assert (full / name).read_bytes() == (killed / name).read_bytes(), name
    assert len(FeatureDataset(killed, split="all")) == 16


def test_ranks_take_disjoint_slices_and_merge(tmp_path, verifier, fingerprint):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=9, vocab=V)
    single, dp = tmp_path / "single", tmp_path / "dp"
    extract_features(verifier, fingerprint, prepared, single, store=StoreOptions(2), progress=False)
    prepared_all = PreparedDataset(prepared, "all", tokenizer_fingerprint=fingerprint)
    r1 = write_features(TransformersFeatures(verifier, fingerprint), prepared_all, dp, store=StoreOptions(2),
                        progress=False, rank=1, world_size=2)
    assert r1.written_samples == 4 and not (dp / "manifest.json").exists()  # rank 1 never merges
    r0 = write_features(TransformersFeatures(verifier, fingerprint), prepared_all, dp, store=StoreOptions(2),
                        progress=False, rank=0, world_size=2)
    assert r0.written_samples == 5 and r0.total_samples == 9
    a, b = FeatureDataset(single, split="all"), FeatureDataset(dp, split="all")
    assert sorted(b.sample_ids) == a.sample_ids
    for i, sid in enumerate(b.sample_ids):
        assert ("-r000-" in b.manifest["samples"][i]["shard"]) == (int(sid[1:]) % 2 == 0)
        j = a.sample_ids.index(sid)
        assert torch.equal(a[j]["aux_hidden_states"], b[i]["aux_hidden_states"])
    # merging again later gives the same manifest
    from eagle3_hf.features.store import merge_manifests

    assert merge_manifests(dp, write=False) == json.loads((dp / "manifest.json").read_text())


@pytest.mark.slow
def test_two_ranks_merge_one_manifest(tmp_path, tiny_verifier_dir, fingerprint):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=9)
    out = tmp_path / "dp"
    procs = []
    for rank in (1, 0):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", _CHILD, str(tiny_verifier_dir), str(prepared), str(out),
                                       fingerprint, "0"], env=env))
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    ds = FeatureDataset(out, split="all")
    assert sorted(ds.sample_ids) == [f"s{i:03d}" for i in range(9)]
    shards = [s["file"] for s in ds.manifest["shards"]]
    assert any("-r000-" in s for s in shards) and any("-r001-" in s for s in shards)
    by_id = {s["id"]: s["shard"] for s in ds.manifest["samples"]}
    assert all(("-r000-" in by_id[f"s{i:03d}"]) == (i % 2 == 0) for i in range(9))


def test_cli_extract(tmp_path, tiny_verifier_dir, fingerprint, capsys):
    from eagle3_hf.cli import main

    prepared = make_prepared(tmp_path / "prep", fingerprint, n=3)
    rc = main(["extract", "--verifier", str(tiny_verifier_dir), "--data", str(prepared), "--output",
               str(tmp_path / "out"), "--features-dtype", "fp8", "--aux-layers", "1,2,4", "--no-progress"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["total_samples"] == 3
    ds = FeatureDataset(tmp_path / "out", split="all")
    assert ds.manifest["dtype"] == "float8_e4m3fn" and ds.manifest["aux_layer_indices"] == [1, 2, 4]
    assert ds.manifest["verifier"]["name"] == str(tiny_verifier_dir)


def test_cli_extract_reads_the_prepared_meta_once_and_refuses_other_samples_before_the_verifier_loads(
        tmp_path, tiny_verifier_dir, fingerprint, capsys, monkeypatch):
    from eagle3_hf.cli import main
    from eagle3_hf.data import prepared_format
    from eagle3_hf.features.commands import extract

    reads: list[str] = []
    read = prepared_format.read_prepared_meta
    monkeypatch.setattr(prepared_format, "read_prepared_meta", lambda path: reads.append(str(path)) or read(path))
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=3)
    argv = ["extract", "--verifier", str(tiny_verifier_dir), "--output", str(tmp_path / "out"), "--no-progress"]
    assert main([*argv, "--data", str(prepared)]) == 0 and reads == [str(prepared)]
    other = make_prepared(tmp_path / "other", "0123456789abcdef", n=3)
    monkeypatch.setattr(extract, "open_source", lambda request: pytest.fail("the verifier loaded before the refusal"))
    capsys.readouterr()
    assert main([*argv, "--data", str(other)]) == 1
    assert "prepared with tokenizer 0123456789abcdef" in capsys.readouterr().err


def test_samples_over_max_model_len_are_skipped_alone_and_counted(tmp_path, tiny_verifier_dir, fingerprint, capsys):
    """`extract --max-model-len M` on a prepared set with longer samples finishes: samples of more than M - 1
    tokens (vLLM's rule, kept on this route too) are skipped, counted in the summary and the manifest; a rerun
    does not retry them."""
    from eagle3_hf.cli import main

    prepared = make_prepared(tmp_path / "prep", fingerprint, n=8, lo=4, hi=40)
    lengths = {r["id"]: len(r["input_ids"]) for r in datasets.load_from_disk(str(prepared))}
    edge = sorted(lengths.values())[4]  # a sample of exactly M - 1 tokens is kept
    over = sorted(i for i, n in lengths.items() if n > edge)
    assert 0 < len(over) < len(lengths)
    command = ["extract", "--verifier", str(tiny_verifier_dir), "--data", str(prepared), "--output",
               str(tmp_path / "out"), "--max-model-len", str(edge + 1), "--samples-per-shard", "2", "--no-progress"]
    capsys.readouterr()
    assert main(command) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["skipped"] == summary["total_skipped"] == {"overlong": len(over)}
    assert summary["total_samples"] == len(lengths) - len(over) and summary["max_sample_tokens"] == edge
    assert f"skipped {len(over)} samples of more than {edge} tokens" in captured.err
    ds = FeatureDataset(tmp_path / "out", split="all")
    assert sorted(ds.manifest["skipped_ids"]["overlong"]) == over
    assert sorted(ds.sample_ids) == sorted(set(lengths) - set(over)) and max(ds.lengths) == edge
    assert main(command) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["written_samples"] == 0 and again["skipped"] == {}
    assert again["total_skipped"] == {"overlong": len(over)}


def test_device_map_with_several_processes_is_refused_in_one_line():
    from eagle3_hf.verifier.placement import check_device_map_launch

    check_device_map_launch("auto", "1")
    check_device_map_launch(None, "8")
    with pytest.raises(ValueError, match=r"--device-map auto with WORLD_SIZE=8: one process shards one verifier"):
        check_device_map_launch("auto", "8")
