"""experiments/compare_finetune_vs_scratch.py at tiny size: sources trained on other conversations answered by their
own verifier version (and one with its own vocabulary), their training reported apart from the comparison budget,
which every run shares and which is read from what each run did."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from eagle3_hf.cli import main as cli
from eagle3_hf.demo_data.prompts import chitchat_conversations

ROOT = Path(__file__).resolve().parents[2]


def _steps_per_epoch(features: Path, validation_fraction: float, max_seq_len: int, batch: int) -> int:
    """Independently of the trainer: packed training rows / batch size."""
    from eagle3_hf.features.packing import PackedDataset
    from eagle3_hf.features.reader import FeatureDataset

    rows = len(PackedDataset(FeatureDataset(features, "train", validation_fraction), max_seq_len))
    return math.ceil(rows / batch)


@torch.no_grad()
def _drift(original: str, drifted: str, prepared: Path, samples: int) -> dict:
    """Independently of experiments.drift: per token of the first `samples` prepared samples, how often the two
    verifiers' greedy tokens agree and KL(original || drifted)."""
    import torch.nn.functional as F

    from eagle3_hf.data.prepared_format import load_prepared
    from eagle3_hf.verifier.loading import load_verifier

    a, b = load_verifier(original), load_verifier(drifted)
    agree = tokens = 0
    kl = 0.0
    for ids in load_prepared(prepared)[0]["input_ids"][:samples]:
        ids = torch.tensor(ids)[None]
        p, q = a(ids).logits[0].float().log_softmax(-1), b(ids).logits[0].float().log_softmax(-1)
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
        kl += float(F.kl_div(q, p, log_target=True, reduction="sum"))
        tokens += ids.shape[1]
    return {"tokens": tokens, "greedy_agreement": agree / tokens, "kl": kl / tokens}


def test_sources_on_other_data_and_the_budget_every_run_shares(tmp_path, tiny_verifier_dir, monkeypatch):
    monkeypatch.setenv("EAGLE3_HF_CACHE", str(tmp_path / "cache"))  # the drifted tiny verifier goes here
    import experiments.compare_finetune_vs_scratch as compare_module
    from experiments.compare_finetune_vs_scratch import main as compare
    from experiments.compare_report import threshold

    convs = tmp_path / "convs.jsonl"
    rows = [c for _, c in zip(range(16), chitchat_conversations())]
    convs.write_text("".join(json.dumps(c) + "\n" for c in rows))
    verifier = str(tiny_verifier_dir)
    assert cli(["prepare", "--tokenizer", verifier, "--input", str(convs), "--output", str(tmp_path / "prep"),
                "--max-seq-len", "64"]) == 0
    assert cli(["extract", "--verifier", verifier, "--data", str(tmp_path / "prep"), "--output",
                str(tmp_path / "feats"), "--features-dtype", "fp32", "--no-progress"]) == 0
    assert cli(["vocab", "--data", str(tmp_path / "prep"), "--draft-vocab-size", "256", "--output",
                str(tmp_path / "feats" / "vocab.safetensors")]) == 0

    out = tmp_path / "cmp"
    args = ["--features", str(tmp_path / "feats"), "--prepared-dir", str(tmp_path / "prep"),
            "--conversations", str(convs), "--build-sources", "--source-prompts", "10",
            "--source-tokens", "4", "--drift-steps", "1", "--drift-held-out", "2",
            "--other-vocab-size", "128", "--verifier", verifier, "--output-dir", str(out), "--epochs", "1",
            "--long-epochs", "2", "--source-epochs", "1", "--max-seq-len", "64",
            "--validation-fraction", "0.25", "--eval-steps", "2", "--eval-prompts", "1",
            "--eval-tokens", "4", "--seed", "3"]
    # --only splits the work; a final invocation without it reuses what is done (docs/results/finetune_vs_scratch.md)
    assert list(compare([*args, "--only", "scratch", "finetune:disjoint"])) == ["scratch", "finetune:disjoint"]
    trained: list[str] = []
    real_train = compare_module.train
    monkeypatch.setattr(compare_module, "train",
                        lambda argv: trained.append(argv[argv.index("--output-dir") + 1]) or real_train(argv))
    results = compare(args)
    short = ["scratch", "finetune:disjoint", "finetune:disjoint-drift-s1", "finetune:disjoint-drift-s1-vocab128"]
    assert list(results) == short + [f"{run}@long" for run in short]
    done_before = {str(out / name) for name in ("scratch", "finetune_disjoint", "source_disjoint")}
    assert not done_before & set(trained) and str(out / "scratch_long") in trained, trained

    def must_not_train(argv):
        raise AssertionError(f"a finished run was trained again: {argv}")

    monkeypatch.setattr(compare_module, "train", must_not_train)
    assert compare(args) == results  # every run and source reused, with its results
    assert json.loads((out / "report.json").read_text()) == results

    # the comparison budget: read from each run, equal within a budget, and what the data implies
    per_epoch = _steps_per_epoch(tmp_path / "feats", 0.25, 64, 2)
    for runs, epochs in ((short, 1), ([f"{r}@long" for r in short], 2)):
        for run in runs:
            b = results[run]["budget"]
            assert (b["seed"], b["epochs"], b["optimizer_steps"]) == (3, epochs, epochs * per_epoch), run
            assert results[run]["curves"]["step"][-1] <= b["optimizer_steps"]

    # sources: other conversations (disjoint ids, regenerated by their own version), their training apart
    ours = {c["id"] for c in rows}
    for run in short[1:]:
        src = results[run]["source_training"]
        assert src["optimizer_steps"] > 0 and src["conversations"] > 0 and src["seed"] == 4
        theirs = [json.loads(line) for line in (Path(src["data"]) / "conversations.jsonl").read_text().splitlines()]
        assert theirs and not ours & {c["id"] for c in theirs}
        assert results[run]["source_before"]["source_acc_0"] is not None
        assert results[run]["advice"].startswith(("at or above", "below"))  # what --finetune-from logged
        assert results[run]["tau"]["lossless"] is True
    assert results["finetune:disjoint"]["source_training"]["verifier"] == "same"
    drifted = results["finetune:disjoint-drift-s1"]["source_training"]
    assert drifted["verifier"] == "drift-s1"
    assert drifted["data"] != results["finetune:disjoint"]["source_training"]["data"]
    vocab = results["finetune:disjoint-drift-s1-vocab128"]["source_training"]
    assert vocab["draft_vocab_size"] == 128 and vocab["data"] == drifted["data"]
    source_config = json.loads((Path(results["finetune:disjoint-drift-s1-vocab128"]["source"]) / "config.json")
                               .read_text())
    assert source_config["draft_vocab_size"] == 128
    drift = results["finetune:disjoint-drift-s1"]["verifier_drift"]
    expected = _drift(verifier, drift["dir"], tmp_path / "prep", 2)  # --drift-held-out 2
    assert drift["tokens"] == expected["tokens"] and expected["kl"] > 0
    assert drift["greedy_agreement"] == pytest.approx(expected["greedy_agreement"], abs=1e-9)
    assert drift["kl"] == pytest.approx(expected["kl"], rel=1e-4)

    report = (out / "report.md").read_text()
    for run in results:
        line = next(ln for ln in report.splitlines() if ln.startswith(f"| {run} |"))
        b, src = results[run]["budget"], results[run]["source_training"]
        assert line.endswith(f"| 3 / {b['epochs']:g} / {b['optimizer_steps']} |")
        assert f"| {src['optimizer_steps'] if src else '—'} |" in line  # the source's steps in their own column
    bound, _ = threshold(results)
    assert f"SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH = {'none' if bound is None else f'{bound:.3f}'}" in report
    assert (out / "curves.png").stat().st_size and (out / "tau_vs_drift.png").stat().st_size


def _result(acc0, sim, steps, source=True):
    return {"source_before": {"source_acc_0": acc0} if source else None, "tau": None,
            "budget": {"optimizer_steps": steps}, "metrics": {"simulated_acceptance_length": sim}}


def test_threshold_is_the_lowest_accuracy_above_every_loser():
    from experiments.compare_report import threshold

    runs = {"scratch": _result(None, 1.30, 10, False), "scratch@long": _result(None, 1.50, 40, False),
            "finetune:a": _result(0.30, 1.40, 10), "finetune:a@long": _result(0.30, 1.55, 40),
            "finetune:b": _result(0.10, 1.35, 10), "finetune:b@long": _result(0.10, 1.45, 40),  # loses when long
            "finetune:c": _result(0.20, 1.33, 10), "finetune:c@long": _result(0.20, 1.51, 40)}
    bound, text = threshold(runs)
    assert bound == 0.20 and "0.100 lost" in text
    runs["finetune:c@long"] = _result(0.20, 1.49, 40)
    assert threshold(runs)[0] == 0.30
    assert threshold({k: v for k, v in runs.items() if not k.startswith("finetune:a")})[0] is None


def test_finetune_advice_states_the_measured_bound():
    from eagle3_hf.train.setup import SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH as bound
    from eagle3_hf.train.setup import finetune_advice

    doc = (ROOT / "docs" / "results" / "finetune_vs_scratch.md").read_text()
    stated = re.findall(r"SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH = ([0-9.]+|none)", doc)
    assert stated and all(s == f"{bound:.3f}" for s in stated)  # the constant is the doc's measured threshold
    assert finetune_advice(bound + 0.05).startswith(f"at or above {bound:.3f}")
    assert finetune_advice(bound - 0.05).startswith(f"below {bound:.3f}")
    assert finetune_advice(float("nan")).startswith("no validation data")
