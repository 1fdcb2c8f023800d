"""`extract --engine vllm`: vLLM's states mapped to our shards (aux ids as they are, the final norm applied
once to vLLM's id N, the greedy token from the verifier's own head), its one-line errors and its timeout,
and (slow, vLLM's CPU build) the same features as `extract` within bf16 storage rounding, distinguishable
from a last layer normed twice or not at all and from an id off by one, trained on for a few epochs.

The slow test needs `make vllm`; without the vLLM venv it is skipped, saying so (EAGLE3_HF_SKIP_VLLM=1
skips it too)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_hf.cli import main
from eagle3_hf.engines.vllm.vllm_env import STAMP, VllmError, VllmExtraction
from eagle3_hf.evaluation.feature_diff import diff_features
from eagle3_hf.features.engine_states import features_from_states, vllm_layer_ids
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.routes.transformers import extract_features
from eagle3_hf.features.vllm.vllm_spec import read_states
from eagle3_hf.features.write import StoreOptions
from eagle3_hf.verifier.capture import capture_features, final_norm
from eagle3_hf.verifier.family import logit_softcap

from tests.helpers.serveable import (
    BF16_STEP,
    HIDDEN,
    LAYERS,
    VOCAB,
    reference_states,
    serveable_verifier,
    walk_prepared,
)
from tests.helpers.vllm import vllm_or_fail

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest per-token relative error ||a - b|| / ||b||."""
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())


# ---------------------------------------------------------------- fast: the mapping and the errors


def test_vllm_states_map_to_capture_features():
    """What vLLM writes (ids ascending, id N before the final norm), mapped here, equals what `extract`
    stores, for aux indices given in any order."""
    model = serveable_verifier()
    ids = torch.arange(1000, 1030)
    aux = (5, 1, 3)
    layer_ids = vllm_layer_ids(aux, LAYERS)
    assert layer_ids == [1, 3, 5, 6]
    hs, pre = reference_states(model, ids)
    states = torch.stack([hs[i] for i in layer_ids[:-1]] + [pre], dim=1)  # [T, 4, H] as vLLM stores it
    got = features_from_states(states, aux, layer_ids, final_norm(model), model.lm_head, logit_softcap(model))
    ref = capture_features(model, ids, aux)
    for key in ("aux_hidden_states", "last_hidden_state"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["verifier_greedy"], ref["verifier_greedy"])
    # the mapping is not the identity: normed twice, not normed, or the ids read in ascending order all differ
    twice = features_from_states(torch.cat([states[:, :3], final_norm(model)(pre)[:, None]], 1), aux, layer_ids,
                                 final_norm(model), model.lm_head, None)
    assert rel(twice["last_hidden_state"], ref["last_hidden_state"]) > 0.05
    assert rel(pre, ref["last_hidden_state"]) > 0.05
    ascending = features_from_states(states, (1, 3, 5), layer_ids, final_norm(model), model.lm_head, None)
    assert not torch.allclose(ascending["aux_hidden_states"], ref["aux_hidden_states"])


def test_layer_ids_out_of_range_refused():
    with pytest.raises(ValueError, match="outside 1..5"):
        vllm_layer_ids((1, 3, 6), LAYERS)


@pytest.mark.parametrize("fault, message", [
    ("short", "hidden_states has shape (9, 4, 16) but token_ids has 10 rows"),
    ("tokens", "token_ids (10) are not sample 's0''s input_ids"),
    ("layers", "holds 3 layers x 16"),
    ("nan", "non-finite hidden states for sample 's0' at vLLM layer ids [3]"),
])
def test_a_bad_file_is_one_line_naming_file_and_sample(tmp_path, fault, message):
    ids = torch.arange(10)
    states, tokens = torch.randn(10, 4, 16), ids.clone()
    if fault == "short":
        states = states[:9]
    elif fault == "tokens":
        tokens[3] += 1
    elif fault == "layers":
        states = states[:, :3].contiguous()
    elif fault == "nan":
        states[4, 1, 2] = float("nan")
    path = tmp_path / "req.safetensors"
    save_file({"hidden_states": states, "token_ids": tokens}, str(path))
    with pytest.raises(ValueError) as err:
        read_states(path, "s0", ids, [1, 3, 5, 6], 16)
    text = str(err.value)
    assert message in text and str(path) in text and "\n" not in text


def test_vllm_missing_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, tiny_verifier_dir, fingerprint):
    from tests.helpers.data import make_prepared

    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(tmp_path / "nowhere"))
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=2)
    capsys.readouterr()  # the dataset's own progress bar
    code = main(["extract", "--engine", "vllm", "--verifier", str(tiny_verifier_dir), "--data", str(prepared),
                 "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: vLLM is not installed: run `make vllm`") and "\n" not in err
    assert not (tmp_path / "out").exists()


@pytest.fixture
def hanging_vllm_venv(tmp_path, monkeypatch):
    """A vLLM venv whose python never answers: the runner's stand-in sleeps."""
    venv = tmp_path / "vllm-venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/bin/sh\necho $$ > \"$(dirname \"$0\")/pid\"\nexec sleep 120\n")
    python.chmod(0o755)
    (venv / STAMP).write_text("test")
    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(venv))
    return venv


def test_a_hung_vllm_is_stopped_after_the_timeout(hanging_vllm_venv):
    start = time.monotonic()
    with pytest.raises(VllmError, match=r"made no progress for 2 s and was stopped"):
        with VllmExtraction({"verifier": "x"}, [(0, [1, 2, 3])], timeout=2) as run:
            list(run.records())
    assert time.monotonic() - start < 30
    pid = int((hanging_vllm_venv / "bin" / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # the stand-in was killed, not left behind
        os.kill(pid, 0)


class StandInRun:
    """VllmExtraction's stand-in: writes each prompt's states as vLLM's connector would ([T, 4, H]: the aux ids,
    then id N before the final norm) from the verifier in this process; keeps every request it was given."""

    runs: list[StandInRun] = []

    def __init__(self, request, prompts, **_kwargs):
        self.request, self.prompts = request, list(prompts)
        self.result, self.peak_pending_bytes = {"vllm_version": "stand-in"}, 0
        StandInRun.runs.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def records(self):
        model, folder = StandInRun.model, Path(tempfile.mkdtemp(prefix="eagle3_standin_"))
        for key, ids in self.prompts:
            hs, pre = reference_states(model, torch.tensor(ids))
            states = torch.stack([hs[i] for i in self.request["layer_ids"][:-1]] + [pre], dim=1)
            path = folder / f"{key}.safetensors"
            save_file({"hidden_states": states, "token_ids": torch.tensor(ids)}, str(path))
            yield {"key": key, "path": str(path)}


def test_samples_over_max_model_len_are_skipped_counted_and_never_sent(tmp_path, monkeypatch, capsys,
                                                                        serveable_model, serveable_dir, fingerprint):
    """`extract --engine vllm --max-model-len M`: vLLM refuses a prompt of M tokens or more, so such a sample is
    skipped alone (counted in the summary and the manifest) and the rank extracts the others, vLLM started with
    context M."""
    import datasets

    import eagle3_hf.engines.vllm.vllm_env as vllm_env

    monkeypatch.setattr(vllm_env, "vllm_python", lambda: "python")
    monkeypatch.setattr(vllm_env, "VllmExtraction", StandInRun)
    StandInRun.model, StandInRun.runs = serveable_model, []
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=8)
    lengths = {r["id"]: len(r["input_ids"]) for r in datasets.load_from_disk(str(prepared))}
    edge = sorted(lengths.values())[len(lengths) // 2]  # a sample of exactly M - 1 tokens is kept
    over = sorted(i for i, n in lengths.items() if n > edge)
    assert 0 < len(over) < len(lengths)
    capsys.readouterr()
    code = main(["extract", "--engine", "vllm", "--verifier", str(serveable_dir), "--data", str(prepared), "--output",
                 str(tmp_path / "f"), "--max-model-len", str(edge + 1), "--samples-per-shard", "3", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["skipped"] == {"overlong": len(over)} == summary["total_skipped"]
    assert summary["written_samples"] == summary["total_samples"] == len(lengths) - len(over)
    assert f"skipped {len(over)} samples of more than {edge} tokens" in captured.err
    (run,) = StandInRun.runs
    assert run.request["max_model_len"] == edge + 1 and max(len(ids) for _, ids in run.prompts) == edge
    ds = FeatureDataset(tmp_path / "f", split="all")
    assert sorted(ds.manifest["skipped_ids"]["overlong"]) == over
    assert sorted(ds.sample_ids) == sorted(set(lengths) - set(over))


# ---------------------------------------------------------------- slow: vLLM's CPU build against transformers


def vllm_command(vdir: Path, prepared: Path, out: Path) -> list[str]:
    """`extract --engine vllm` of the walk as both slow tests below run it: 2 samples per shard and per vLLM call."""
    return [EAGLE3_HF, "extract", "--engine", "vllm", "--verifier", str(vdir), "--data", str(prepared), "--output",
            str(out), "--samples-per-shard", "2", "--vllm-batch-size", "2", "--no-progress"]


@pytest.fixture(scope="module")
def walk_extracted(tmp_path_factory, tokenizer, fingerprint) -> dict:
    """The serveable verifier's 12-sample walk extracted by transformers (in process) and, uninterrupted, by vLLM's
    CPU build: once for the module, read by the features test and the kill-and-resume test (its reference)."""
    vllm_or_fail()
    root = tmp_path_factory.mktemp("walk_extracted")
    verifier = serveable_verifier()
    vdir = root / "verifier"
    verifier.save_pretrained(vdir)
    tokenizer.save_pretrained(vdir)
    prepared = walk_prepared(root / "prepared", fingerprint)
    by_transformers, by_vllm = root / "f_transformers", root / "f_vllm"
    extract_features(verifier, fingerprint, prepared, by_transformers, store=StoreOptions(2), verifier_name=str(vdir),
                     progress=False)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(vllm_command(vdir, prepared, by_vllm), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"verifier": verifier, "vdir": vdir, "prepared": prepared, "transformers": by_transformers,
            "vllm": by_vllm, "summary": json.loads(result.stdout.strip().splitlines()[-1]), "env": env}


@pytest.mark.slow
def test_vllm_features_equal_extracts_and_train(walk_extracted, tmp_path, fingerprint):
    verifier, vdir, summary = walk_extracted["verifier"], walk_extracted["vdir"], walk_extracted["summary"]
    by_transformers, by_vllm = walk_extracted["transformers"], walk_extracted["vllm"]
    assert summary["connector"] == "CpuHiddenStatesConnector" and summary["vllm_version"] == "0.32.0"
    assert summary["written_samples"] == summary["total_samples"] == 12 and summary["vllm_dtype"] == "float32"
    assert 0 < summary["peak_temporary_bytes"] <= 16 * 40 * 4 * HIDDEN * 4 + 16 * 4096  # never more than 16 files

    # the same shard format: keys, dtypes, shards, checksums (FeatureDataset verifies every shard's sha256)
    a, b = (FeatureDataset(d, split="all", verify="shard") for d in (by_transformers, by_vllm))
    assert b.manifest["source"] == "vllm" and a.manifest["source"] == "transformers"
    for key in ("verifier", "tokenizer_fingerprint", "aux_layer_indices", "dtype"):
        assert a.manifest[key] == b.manifest[key], key
    assert [s["id"] for s in a.manifest["samples"]] == [s["id"] for s in b.manifest["samples"]]
    assert len(b.manifest["shards"]) == 6
    for sa, sb in zip(a.manifest["shards"], b.manifest["shards"]):
        with safe_open(by_transformers / sa["file"], "pt") as fa, safe_open(by_vllm / sb["file"], "pt") as fb:
            assert sorted(fa.keys()) == sorted(fb.keys())
            for k in fa.keys():
                assert fa.get_slice(k).get_dtype() == fb.get_slice(k).get_dtype()
                assert fa.get_slice(k).get_shape() == fb.get_slice(k).get_shape()

    # diff-features: every layer within bf16 storage rounding, the same greedy tokens
    report = diff_features(by_transformers, by_vllm)
    assert report["samples_compared"] == 12 and report["token_mismatch"] == 0
    for name, stats in report["layers"].items():
        assert stats["rel_err_max"] <= BF16_STEP + 1e-4 and stats["cos_min"] > 0.9999, (name, stats)
    assert report["greedy_agreement"] == 1.0

    # ... and far from what a wrong mapping would have stored
    aux = b.aux_layer_indices
    for i in range(len(b)):
        item = b[i]
        hs, pre = reference_states(verifier, item["input_ids"])
        last = item["last_hidden_state"]
        assert rel(last, verifier.model.norm(pre)) <= BF16_STEP + 1e-4
        assert rel(last, pre) > 0.1 and rel(last, verifier.model.norm(verifier.model.norm(pre))) > 0.1
        for k, index in enumerate(aux):
            got = item["aux_hidden_states"][:, k * HIDDEN:(k + 1) * HIDDEN]
            assert rel(got, hs[index]) <= BF16_STEP + 1e-4
            assert rel(got, hs[index - 1]) > 0.1 and rel(got, hs[index + 1]) > 0.1, (index, i)

    # trained on: a few epochs on vLLM's features lift step-0 accuracy
    from eagle3_hf.data.vocab import save_vocab
    from eagle3_hf.model.checkpoint import vocab_from_target_ids
    from eagle3_hf.scripts.train import main as train_main

    greedy = torch.cat([b[i]["verifier_greedy"] for i in range(len(b))]).unique()
    d2t, t2d = vocab_from_target_ids(greedy, VOCAB)
    features = tmp_path / "f_vllm"  # a copy with its vocabulary: the module's extraction stays as vLLM wrote it
    shutil.copytree(by_vllm, features)
    save_vocab(features / "vocab.safetensors", d2t, t2d, fingerprint, coverage=1.0)
    trained = train_main(["--verifier", str(vdir), "--features", str(features), "--output-dir", str(tmp_path / "run"),
                          "--num-train-epochs", "8", "--logging-steps", "1", "--save-strategy", "no",
                          "--eval-strategy", "no",
                          "--max-seq-len", "128", "--per-device-train-batch-size", "2", "--learning-rate", "1e-2",
                          "--disable-tqdm", "true", "--seed", "7", "--warmup-steps", "2"])
    logs = [h for h in trained["log_history"] if "acc_0" in h]
    assert logs and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs if "loss" in h)
    assert logs[0]["acc_0"] < 0.1 and logs[-1]["acc_0"] > 0.5, [h["acc_0"] for h in logs]  # measured 0 -> 0.81


@pytest.mark.slow
def test_vllm_extracts_past_samples_longer_than_its_context(tmp_path, tokenizer, fingerprint):
    """vLLM's CPU build with --max-model-len shorter than some samples: they are skipped and counted, the rank
    finishes, and what it wrote equals the transformers route's features for the same command line."""
    vllm_or_fail()
    verifier = serveable_verifier()
    vdir = tmp_path / "verifier"
    verifier.save_pretrained(vdir)
    tokenizer.save_pretrained(vdir)
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=6)
    import datasets

    lengths = sorted(len(r["input_ids"]) for r in datasets.load_from_disk(str(prepared)))
    edge = lengths[len(lengths) // 2]
    over = sum(n > edge for n in lengths)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    summaries = {}
    for engine in ("vllm", "transformers"):
        result = subprocess.run([EAGLE3_HF, "extract", "--engine", engine, "--verifier", str(vdir), "--data",
                                 str(prepared), "--output", str(tmp_path / engine), "--max-model-len", str(edge + 1),
                                 "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        summaries[engine] = json.loads(result.stdout.strip().splitlines()[-1])
    for summary in summaries.values():
        assert summary["total_skipped"] == {"overlong": over} and summary["total_samples"] == 6 - over
    report = diff_features(tmp_path / "transformers", tmp_path / "vllm")
    assert report["samples_compared"] == 6 - over and report["only_in_a"] == report["only_in_b"] == 0


@pytest.mark.slow
def test_vllm_extraction_killed_resumes_with_nothing_lost_or_duplicated(walk_extracted, tmp_path):
    from tests.helpers.data import kill_after_shards

    vdir, reference, env = walk_extracted["vdir"], walk_extracted["transformers"], walk_extracted["env"]
    out = tmp_path / "f_vllm"
    command = vllm_command(vdir, walk_extracted["prepared"], out)
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ours() -> list[Path]:
        return [d for d in Path(tempfile.gettempdir()).glob("eagle3_vllm_extract_*") if (d / "request.json").is_file()
                and json.loads((d / "request.json").read_text())["verifier"] == str(vdir)]

    deadline = time.monotonic() + 600
    while not ours() and proc.poll() is None and time.monotonic() < deadline:  # the reader makes it first
        time.sleep(0.02)
    orphaned = ours()
    assert len(orphaned) == 1  # the reader's directory, soon the killed reader's
    kill_after_shards(proc, out / "manifest.r000.jsonl", shards=2, timeout=600)
    assert not (out / "manifest.json").exists()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["resumed_past"] >= 4 and summary["total_samples"] == 12
    assert summary["written_samples"] == 12 - summary["resumed_past"]
    b = FeatureDataset(out, split="all", verify="shard")  # every shard's checksum hashed
    assert sorted(b.sample_ids) == sorted(FeatureDataset(reference, split="all").sample_ids)
    assert len(set(b.sample_ids)) == 12
    report = diff_features(reference, out)
    assert report["samples_compared"] == 12 and report["token_mismatch"] == 0 and report["greedy_agreement"] == 1.0
    assert all(s["rel_err_max"] <= BF16_STEP + 1e-4 for s in report["layers"].values()), report["layers"]
    # and the same bytes as the uninterrupted run of the same command
    uninterrupted = diff_features(walk_extracted["vllm"], out)
    assert uninterrupted["samples_compared"] == 12 and uninterrupted["token_mismatch"] == 0
    assert all(s["rel_err_max"] == 0.0 for s in uninterrupted["layers"].values()), uninterrupted["layers"]
    # the orphaned runner removes its directory when it learns its reader is gone, or, if it had finished
    # before the kill, the resumed run's start or end removes it; the runner is a process of its own: wait for it
    deadline = time.monotonic() + 120
    while orphaned[0].exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not orphaned[0].exists()
