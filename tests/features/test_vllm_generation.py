"""`regenerate --engine vllm`: answers, prepared dataset and features from one vLLM engine, killed and resumed.

Slow (vLLM's CPU build, `make vllm`; skipped without it, or with EAGLE3_HF_SKIP_VLLM=1): on the tiny serveable
verifier, the answers are vLLM's plain greedy answers, the prepared dataset is `prepare`'s of those
conversations, the features are bit-equal to `extract --engine vllm` on that prepared dataset and within bf16
rounding of transformers' `extract`, and a run killed after its first shard resumes with nothing lost or
duplicated. Four vLLM starts (killed run, resumed run, plain generation, extract --engine vllm)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch

from eagle3_hf.data.conversations import load_conversations
from eagle3_hf.data.prepare import prepare_conversations
from eagle3_hf.evaluation.feature_diff import diff_features
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.routes.transformers import extract_features
from eagle3_hf.features.vllm.vllm_generation import eos_ids, generate_plain, prompt_ids
from eagle3_hf.features.write import StoreOptions

from tests.helpers.data import kill_after_shards
from tests.helpers.serveable import BF16_STEP, serveable_verifier
from tests.helpers.vllm import vllm_or_fail

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")
QUESTIONS = ["What is two plus two?", "Name a colour.", "Say hello.", "Count to three.", "Why is the sky blue?",
             "Tell me a joke."]
MAX_NEW, MODEL_LEN = 12, 256


@pytest.mark.slow
def test_vllm_regenerate_end_to_end_killed_and_resumed(tmp_path, tokenizer, fingerprint):
    vllm_or_fail()
    verifier = serveable_verifier()
    vdir = tmp_path / "verifier"
    verifier.save_pretrained(vdir)
    tokenizer.save_pretrained(vdir)
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                             for i, q in enumerate(QUESTIONS)))
    answers, feats, prepared = tmp_path / "answers.jsonl", tmp_path / "f_regen", tmp_path / "prepared"
    command = [EAGLE3_HF, "regenerate", "--engine", "vllm", "--input", str(convs), "--output", str(answers),
               "--verifier", str(vdir), "--max-new-tokens", str(MAX_NEW), "--features-out", str(feats),
               "--prepared-out", str(prepared), "--samples-per-shard", "2", "--vllm-batch-size", "2",
               "--max-model-len", str(MODEL_LEN), "--no-progress"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    # killed once its first shard is journaled (answers all written, features partly), then the same command
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_after_shards(proc, feats / "manifest.r000.jsonl", shards=1, timeout=600)
    assert not (feats / "manifest.json").exists()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["already_answered"] == 6 and "conversations" not in summary  # nothing generated again
    assert summary["resumed_past"] >= 2 and summary["written_samples"] == 6 - summary["resumed_past"]
    assert summary["total_samples"] == 6 and summary["connector"] == "CpuHiddenStatesConnector"

    # the answers: one line per conversation, each vLLM's plain greedy answer to the same prompt
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == [f"c{i}" for i in range(6)]
    by_id = {r["id"]: r for r in rows}
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}], None) for q in QUESTIONS]
    plain, _ = generate_plain(str(vdir), prompts, max_new_tokens=MAX_NEW, max_model_len=MODEL_LEN)
    eos = eos_ids(str(vdir), tokenizer)
    for i, (ids, finish) in enumerate(plain):
        ids = ids[:-1] if finish == "stop" and ids and ids[-1] in eos else ids
        row = by_id[f"c{i}"]
        assert row["messages"][-1] == {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
        assert row["regenerated"]["finish_reasons"] == [finish]
    assert sum(len(ids) for ids, _ in plain) > 6  # the answers are not empty

    # the prepared dataset: what `prepare` makes from those conversations
    want = prepare_conversations(load_conversations(str(answers)), tokenizer)
    got = datasets.load_from_disk(str(prepared))
    assert got["id"] == want["id"] and got["input_ids"] == want["input_ids"] and got["loss_mask"] == want["loss_mask"]

    # the features: bit-equal to `extract --engine vllm` on that dataset (same batching, same context length) ...
    by_extract = tmp_path / "f_extract"
    result = subprocess.run([EAGLE3_HF, "extract", "--engine", "vllm", "--verifier", str(vdir), "--data",
                             str(prepared), "--output", str(by_extract), "--samples-per-shard", "2",
                             "--vllm-batch-size", "2", "--max-model-len", str(MODEL_LEN), "--no-progress"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    a, b = (FeatureDataset(d, split="all", verify="shard") for d in (feats, by_extract))  # checksums hashed
    assert a.manifest["source"] == b.manifest["source"] == "vllm"
    for key in ("verifier", "tokenizer_fingerprint", "aux_layer_indices", "dtype", "provenance"):
        assert a.manifest.get(key) == b.manifest.get(key), key
    assert sorted(a.sample_ids) == sorted(b.sample_ids) == sorted(want["id"]) and len(set(a.sample_ids)) == 6
    index = {sid: k for k, sid in enumerate(b.sample_ids)}
    for k, sid in enumerate(a.sample_ids):
        x, y = a[k], b[index[sid]]
        for name in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state", "verifier_greedy"):
            assert torch.equal(x[name], y[name]), (sid, name)

    # ... and within bf16 rounding of transformers' extract, the same greedy tokens
    by_transformers = tmp_path / "f_transformers"
    extract_features(verifier, fingerprint, prepared, by_transformers, store=StoreOptions(2), verifier_name=str(vdir),
                     progress=False)
    report = diff_features(by_transformers, feats)
    assert report["samples_compared"] == 6 and report["token_mismatch"] == 0 and report["greedy_agreement"] == 1.0
    for name, stats in report["layers"].items():
        assert stats["rel_err_max"] <= BF16_STEP + 1e-4 and stats["cos_min"] > 0.9999, (name, stats)


# ---------------------------------------------------------------- fast: one-line errors, before anything is written


def _convs(tmp_path: Path) -> Path:
    convs = tmp_path / "convs.jsonl"
    convs.write_text(json.dumps({"id": "c0", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    return convs


def test_vllm_missing_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, tiny_verifier_dir):
    from eagle3_hf.cli import main

    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(tmp_path / "nowhere"))
    code = main(["regenerate", "--engine", "vllm", "--input", str(_convs(tmp_path)), "--output",
                 str(tmp_path / "a.jsonl"), "--verifier", str(tiny_verifier_dir), "--features-out",
                 str(tmp_path / "f")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: vLLM is not installed: run `make vllm`") and "\n" not in err
    assert not (tmp_path / "a.jsonl").exists() and not (tmp_path / "f").exists()


def test_layer_ids_out_of_range_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, tiny_verifier_dir):
    from eagle3_hf.cli import main
    from eagle3_hf.engines.vllm.vllm_env import STAMP

    venv = tmp_path / "vllm-venv"  # a venv that passes the install check; vLLM itself is never started
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 1\n")
    (venv / STAMP).write_text("test")
    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(venv))
    code = main(["regenerate", "--engine", "vllm", "--input", str(_convs(tmp_path)), "--output",
                 str(tmp_path / "a.jsonl"), "--verifier", str(tiny_verifier_dir), "--features-out", str(tmp_path / "f"),
                 "--aux-layers", "1,2,99"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: ") and "outside 1.." in err and "\n" not in err
    assert not (tmp_path / "a.jsonl").exists() and not (tmp_path / "f").exists()
