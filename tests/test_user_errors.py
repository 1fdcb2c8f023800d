"""Bad input a new user tries: one line `error: ...` and a non-zero exit, never a traceback (unless asked
for with --debug), never a silent success; empty prepared datasets and checkpoints that are not drafters
refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_hf import cli
from eagle3_hf.data.conversations import write_jsonl
from eagle3_hf.errors import DEBUG_ENV, debug_requested

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
LONELY = [{"role": "user", "content": "hi"}]


def run_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess; EAGLE3_HF_DEBUG only where `env` sets it (a debugging shell's is dropped)."""
    env = {k: v for k, v in os.environ.items() if k != DEBUG_ENV} | dict(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                                                                        **(env or {}))
    return subprocess.run([sys.executable, "-m", "eagle3_hf.cli", *argv], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)


def assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr[-2000:]
    for needle in needles:
        assert needle in last


def test_user_error_is_one_line_and_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "nowhere")
    assert_one_line_error(run_cli("vocab", "--data", missing, "--draft-vocab-size", "8"), missing,
                          "not a prepared dataset")
    assert_one_line_error(run_cli("diff-features", missing, missing), missing)
    for debug in (run_cli("--debug", "vocab", "--data", missing, "--draft-vocab-size", "8"),
                  run_cli("vocab", "--data", missing, "--draft-vocab-size", "8", env={DEBUG_ENV: "1"})):
        assert debug.returncode != 0 and "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), (" off ", False), ("False", False),
                                      ("1", True), ("yes", True), ("true", True)])
def test_debug_is_asked_for_by_the_variable_unless_empty_or_false(value, on, monkeypatch):
    if value is None:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(DEBUG_ENV, value)
    assert debug_requested() is on


@pytest.mark.parametrize("argv,says", [
    (["train", "--features", "{missing}", "--output-dir", "{tmp}/run"], "no features here"),
    (["export", "{missing}", "--output", "{tmp}/exported"], "neither a checkpoint directory nor a Hub repo id"),
    (["import-features", "speculators", "{missing}", "--data", "{missing}", "--output", "{tmp}/imp",
      "--verifier", "smollm2-135m-instruct"], "not a prepared dataset"),
    (["prepare", "--input", "{missing}.jsonl", "--output", "{tmp}/prep"], "no such file"),
])
def test_in_process_user_errors_return_one_line(argv, says, tmp_path, capsys):
    argv = [a.format(missing=tmp_path / "nowhere", tmp=tmp_path) for a in argv]
    assert cli.main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "nowhere" in err[-1] and says in err[-1]


def test_a_bug_keeps_its_traceback(monkeypatch):
    """An unexpected exception type is a bug: it is not folded into a one-line user error."""
    import eagle3_hf.data.vocab as vocab

    def broken(args):
        raise TypeError("a genuine bug")

    monkeypatch.setattr(vocab, "run", broken)
    with pytest.raises(TypeError, match="a genuine bug"):
        cli.main(["vocab", "--data", "x", "--draft-vocab-size", "8"])


# ---------------------------------------------------------------- empty prepared datasets

def test_prepare_with_nothing_left_exits_nonzero(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": f"q{i}", "messages": LONELY} for i in range(3)])
    out = tmp_path / "prepared"
    rc = cli.main(["prepare", "--tokenizer", "smollm2-135m-instruct", "--input", str(src), "--output", str(out)])
    assert rc != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "0 samples" in err[-1] and "no assistant turn" in err[-1]
    assert not out.exists()


@pytest.fixture
def empty_prepared(tmp_path, tokenizer):
    """A prepared dataset with no rows (written by an older prepare or by hand)."""
    from eagle3_hf.data.prepare import build_meta, new_stats, prepare_conversations
    from eagle3_hf.data.prepared_format import save_prepared

    stats = new_stats()
    ds = prepare_conversations([{"id": "q0", "messages": LONELY}], tokenizer, stats=stats)
    assert len(ds) == 0
    return save_prepared(ds, tmp_path / "empty", build_meta(tokenizer, "smollm2-135m-instruct", stats, {}))


def test_every_reader_of_an_empty_prepared_dataset_names_it(empty_prepared, tmp_path, tiny_verifier_dir, capsys):
    from eagle3_hf.data.prepared_samples import PreparedDataset

    expected = f"prepared dataset {empty_prepared} has 0 samples"
    for argv in (["extract", "--verifier", str(tiny_verifier_dir), "--data", str(empty_prepared), "--output",
                  str(tmp_path / "feats"), "--no-progress"],
                 ["vocab", "--data", str(empty_prepared), "--draft-vocab-size", "8"]):
        assert cli.main(argv) != 0
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith("error: ") and expected in last
    with pytest.raises(ValueError, match=expected):
        PreparedDataset(empty_prepared)


def test_prepare_records_the_ids_it_skipped(tmp_path):
    from eagle3_hf.data.prepared_format import load_prepared

    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "c0", "messages": CHAT}, {"id": "lonely-1", "messages": LONELY},
                      {"id": "c1", "messages": CHAT}, {"id": "lonely-2", "messages": LONELY}])
    out = tmp_path / "prepared"
    assert cli.main(["prepare", "--tokenizer", "smollm2-135m-instruct", "--input", str(src), "--output", str(out),
                     "--max-seq-len", "40", "--overlong", "truncate"]) == 0
    _ds, meta = load_prepared(out)
    assert meta["counts"]["skipped"] == {"no assistant turn": 2}
    assert meta["skipped_ids"] == {"no assistant turn": ["lonely-1", "lonely-2"]}
    assert "hi" not in json.dumps(meta["skipped_ids"])  # ids only, never the text


# ---------------------------------------------------------------- checkpoints that are not (this verifier's) drafters

def test_finetune_from_a_verifier_says_it_is_not_a_drafter(synthetic, tmp_path, capsys):
    verifier_dir = str(synthetic["verifier_dir"])
    rc = cli.main(["train", "--verifier", verifier_dir, "--features", str(synthetic["features"]), "--output-dir",
                   str(tmp_path / "run"), "--finetune-from", verifier_dir, "--max-seq-len", "64",
                   "--report-to", "none", "--disable-tqdm", "true"])
    assert rc != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"error: {verifier_dir} is not an EAGLE-3 drafter (it is a 6-layer LlamaForCausalLM): a " \
                   "drafter has fc.weight and midlayer.*"


def test_evaluate_with_a_drafter_for_another_verifier_names_that_verifier(synthetic, tmp_path, tiny_verifier_dir,
                                                                           capsys):
    from eagle3_hf import Eagle3Config, Eagle3DraftModel
    from eagle3_hf.data.vocab import vocab_from_target_ids

    config = Eagle3Config.from_verifier(synthetic["verifier"].config, draft_vocab_size=32,
                                        aux_hidden_state_indices=[1, 3, 4], verifier_name_or_path="org/synthetic-256")
    drafter = Eagle3DraftModel(config)
    drafter.set_vocab_mapping(*vocab_from_target_ids(torch.arange(32), config.vocab_size))
    drafter.save_pretrained(tmp_path / "drafter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "Name a color."}\n')
    rc = cli.main(["evaluate", "--drafter", str(tmp_path / "drafter"), "--verifier", str(tiny_verifier_dir),
                   "--prompts", str(prompts), "--max-new-tokens", "4", "--output", str(tmp_path / "eval"),
                   "--no-progress", "--device", "cpu"])
    assert rc != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "built for org/synthetic-256" in last and "vocab_size 256" in last


def test_train_script_reports_user_errors_in_one_line(tmp_path):
    """`accelerate launch examples/train.py ...` is how most users train: its bad input reads like the CLI's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop(DEBUG_ENV, None)
    result = subprocess.run([sys.executable, str(ROOT / "examples/train.py"), "--features", str(tmp_path / "none"),
                             "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                            env=env, cwd=ROOT)
    assert_one_line_error(result, str(tmp_path / "none"))
