"""The live check against vLLM: `evaluate --engine vllm --skip-transformers` warns when vLLM accepts less than the
drafter's training recorded (fast: vLLM's runner replaced by its answer), and (slow) `eagle3-hf check --endpoint`
against a real vLLM CPU server serving the trained drafter of `served_pair`, then broken exports of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_hf.cli import main

from tests.helpers.vllm import vllm_or_fail

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")


def _runner(accepted_per_pos: list[int], drafts: int) -> dict:
    tokens = list(range(5, 5 + 16))
    run = {"outputs": [tokens], "seconds": [1.0], "margins": [[1.0] * 16]}
    spec = {"drafts": drafts, "accepted": sum(accepted_per_pos), "accepted_per_pos": accepted_per_pos,
            "per_step_accepted": []}
    return {"vllm_version": "0.32.0", "plain": run, "spec": dict(run, spec=[spec])}


@pytest.mark.parametrize("served, warned", [([48, 36, 24], False), ([4, 0, 0], True)], ids=["as-trained", "gap"])
def test_evaluate_skip_transformers_compares_with_what_training_recorded(
        served, warned, fake_vllm_venv, tiny_verifier_dir, tmp_path, monkeypatch, capsys):
    from eagle3_hf.evaluation import vllm_engine

    from tests.helpers.drafters import random_drafter
    from tests.helpers.verifiers import make_tiny_verifier

    drafter = tmp_path / "drafter"
    random_drafter(make_tiny_verifier(), draft_vocab_size=256).save_pretrained(drafter)
    (drafter / "eagle3_training.json").write_text(json.dumps({"metrics": {
        "step_conditional_accuracy": [0.8, 0.7, 0.6]}}))
    monkeypatch.setattr(vllm_engine, "run_vllm", lambda request, **_: _runner(served, 60))
    out = tmp_path / "eval"
    assert main(["evaluate", "--engine", "vllm", "--skip-transformers", "--drafter", str(drafter), "--verifier",
                 str(tiny_verifier_dir), "--num-prompts", "1", "--max-new-tokens", "16", "--k", "3", "--output",
                 str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err
    summary = json.loads((out / "eagle3_evaluation_vllm.json").read_text())["served_vs_training"]
    assert summary["ok"] is (not warned) and summary["recorded_conditional_accuracy"] == [0.8, 0.7, 0.6]
    assert ("WARNING: vLLM 0.32.0 accepts" in err) is warned and ("likely causes: aux-layer ids" in err) is warned
    assert ("served as trained: vLLM 0.32.0 accepts 0.80 / 0.75 / 0.67" in err) is (not warned)


# ---------------------------------------------------------------- slow: a real vLLM CPU server

# The broken export: the trained weights with every aux-layer id one layer early, consistently in both keys (what
# vLLM captures when it reads SGLang-form ids, eagle_config's, as its own, or a converter that subtracts the 1
# twice). Static `check` finds nothing wrong with it; only what the engine serves shows it. No RoPE alteration is
# served here: the toy drafter reads its token at distance 0, where every rotation is the identity, so rope_theta 1e6
# or a YaRN that scales q.k by 294 or by 1/294 served within the tolerance of what it was trained on (vLLM, a drafter
# trained 60 steps on random prompts: 0.28 / 0.15 and 0.24 / 0.08 conditional against 0.27 / 0.19 as trained).
def shifted_aux_ids(cfg: dict) -> dict:
    ids = list(cfg["eagle_aux_hidden_state_layer_ids"])
    return {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
            "eagle_config": {**cfg["eagle_config"], "eagle_aux_hidden_state_layer_ids": [i - 2 for i in ids]}}


@pytest.fixture(scope="module")
def live_pair(tmp_path_factory, tokenizer):
    """(verifier dir, drafter dir with the validation metrics training records, broken config overrides): a drafter
    trained on the verifier's greedy answers to 32 MT-bench questions (as `regenerate` makes them), validated on 8
    others; `check` then asks the dev prompts."""
    from eagle3_hf.evaluation.evaluate import load_prompts

    from tests.helpers.speculative_server import (
        chat_samples,
        layered_chain_verifier,
        record_validation,
        train_on_samples,
    )

    root = tmp_path_factory.mktemp("live_pair")
    verifier = layered_chain_verifier()
    verifier.save_pretrained(root / "verifier")
    tokenizer.save_pretrained(root / "verifier")
    questions = [row["turns"][0] for row in load_prompts("mt-bench")[0]]
    drafter = train_on_samples(verifier, chat_samples(verifier, tokenizer, questions[8:40]), steps=120)
    drafter.save_pretrained(root / "drafter")
    record_validation(drafter, verifier, root / "drafter", chat_samples(verifier, tokenizer, questions[:8]))
    cfg = json.loads((root / "drafter" / "config.json").read_text())
    return root / "verifier", root / "drafter", {"aux-ids-1": shifted_aux_ids(cfg)}


def _variant(drafter: Path, where: Path, **config: object) -> Path:
    """A copy of the export with config.json keys replaced."""
    where.mkdir()
    for f in drafter.iterdir():
        (where / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((drafter / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**cfg, **config}, indent=2))
    return where


def _check(drafter: Path, url: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([EAGLE3_HF, "check", str(drafter), "--endpoint", url, "--num-prompts", "4",
                           "--max-new-tokens", "32"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_check_endpoint_against_vllm_passes_the_export_and_fails_broken_ones(live_pair, tmp_path):
    """One vLLM server per export (the drafter is fixed at start): the export as trained passes with its numbers;
    the same weights served with other aux-layer ids fail in one line, while the static check passes both (the
    verdict line: the live finding is the one error)."""
    from tests.helpers.speculative_server import SpeculativeServer

    vllm_or_fail()
    verifier, drafter, broken = live_pair
    exports = {"as-trained": drafter}
    exports.update({name: _variant(drafter, tmp_path / name, **cfg) for name, cfg in broken.items()})
    lines, started = {}, time.monotonic()
    for name, path in exports.items():
        with SpeculativeServer(verifier, path, tmp_path / f"{name}.log") as server:
            result = _check(path, server.url)
        found = [ln for ln in result.stdout.splitlines() if "served-acceptance" in ln]
        assert len(found) == 1, result.stdout[-3000:] + result.stderr[-3000:]
        lines[name] = (result.returncode, found[0], result.stdout.strip().splitlines()[-1])
        print(f"\n{name} ({time.monotonic() - started:.0f} s): exit {result.returncode}, {result.stdout.strip()}")
    code, line, verdict = lines.pop("as-trained")
    assert code == 0 and line.startswith("INFO") and "within 0.15 of it at every position" in line
    assert verdict.startswith("OK: 0 error(s)")
    for name, (code, line, verdict) in lines.items():
        assert code == 1 and line.startswith("ERROR") and "likely causes: aux-layer ids" in line, (name, line)
        assert verdict.startswith("FAILED: 1 error(s)"), (name, verdict)
