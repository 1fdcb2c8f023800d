"""/dev/shm: what a node's data loaders hold at peak (`plan` prints it), and `train` refusing, in one line saying
what to change, to start on a node whose /dev/shm cannot hold it, before any feature is read. The formula is
checked against measured peaks by bench/shm_loader.py (docs/results/shm.md)."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from eagle3_hf.cli import main as cli_main
from eagle3_hf.scripts.train import run_script
from eagle3_hf.train import shm

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "examples/recipes/kimi_k25_text_config.json")
Usage = namedtuple("Usage", "total used free")


def test_a_kimi_row_and_a_node_of_eight_ranks():
    row = shm.row_bytes(2048, 7168)  # bf16 aux [2048, 3 x 7168] + last [2048, 7168] + ids, positions, mask
    assert row == 2048 * (4 * 7168 * 2 + 4 * 8 + 1) == 117_508_096
    need = shm.shm_need(ranks=8, workers=4, prefetch=4, train_rows=1, eval_rows=0, eval_within_epoch=False,
                        max_seq_len=2048, target_hidden=7168)
    assert need.rows_per_rank == 4 * 4 + 1 and need.bytes == 8 * 17 * row  # 16.0 GB: 64 MB would die at step 0
    # evaluation every N steps: the training loader's 16 rows stay in flight beside the evaluation loader's
    inside = shm.shm_need(ranks=8, workers=4, prefetch=4, train_rows=1, eval_rows=8, eval_within_epoch=True,
                          max_seq_len=2048, target_hidden=7168)
    assert inside.bytes == 8 * (16 * 1 + 17 * 8) * row
    none = shm.shm_need(ranks=8, workers=0, prefetch=None, train_rows=1, eval_rows=1, eval_within_epoch=True,
                        max_seq_len=2048, target_hidden=7168)
    assert none.bytes == 0  # batches built in the training processes
    assert shm.row_bytes(2048, 7168, "fp8") == 2048 * (4 * 7168 * 4 + 33)  # fp8 is decoded to float32 in a batch


def test_plan_prints_what_the_kimi_recipe_needs(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert cli_main(["plan", str(ROOT / "examples/recipes/kimi_k25_8gpu_ddp.yaml"), "--accelerate-config",
                     str(ROOT / "accelerate_configs/8gpu_ddp.yaml"), "--verifier-config", KIMI,
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    entry = json.loads(out.read_text())["shm"]
    # the recipe: 4 workers, prefetch 4 (the script's GPU default), 1-row batches, evaluation every 500 steps
    assert (entry["ranks"], entry["workers"], entry["prefetch"], entry["train_rows"], entry["eval_rows"]) == \
        (8, 4, 4, 1, 1)
    assert entry["bytes"] == 8 * (16 + 17) * 117_508_096
    assert "/dev/shm    28.9 GiB per node (8 rank(s) x 16 training + 17 evaluation rows" in text


def tiny_shm(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(64 << 20, (64 << 20) - free, free))


def test_train_refuses_a_small_dev_shm_in_one_line_before_reading_features(tmp_path, tiny_verifier_dir,
                                                                            monkeypatch, capsys):
    tiny_shm(monkeypatch, 1 << 20)  # 1 MiB free
    argv = ["--features", str(tmp_path / "not_extracted_yet"), "--verifier", str(tiny_verifier_dir),
            "--output-dir", str(tmp_path / "run"), "--dataloader-num-workers", "2", "--max-seq-len", "512"]
    assert run_script(argv) == 1
    err = capsys.readouterr().err.strip()
    # 2 workers x torch's prefetch 2, + 1 in hand, of 8-row evaluation batches (transformers' default) at the end
    # of each epoch: 40 rows of 512 x (4 x 64 x 2 + 33) bytes
    assert "\n" not in err and err.startswith("error: /dev/shm has 1 MiB free but the data loaders need 11 MiB "
                                              "on this node (1 rank(s) x 40 rows in flight x 0.3 MB")
    assert "`docker run --ipc=host` (or `--shm-size 1g`)" in err and "--dataloader-num-workers" in err
    assert err.endswith("(--shm-check warn starts anyway)")
    # warned, the run goes on to the features, which it reads only now (and does not find)
    assert run_script([*argv, "--shm-check", "warn"]) == 1
    warned = capsys.readouterr().err.strip().splitlines()
    assert warned[0].startswith("WARNING: /dev/shm has 1 MiB free") and "not_extracted_yet" in warned[-1]


@pytest.mark.parametrize("flags", [["--dataloader-num-workers", "0"], ["--shm-check", "off"]])
def test_no_workers_or_no_check_need_nothing(tmp_path, tiny_verifier_dir, monkeypatch, capsys, flags):
    tiny_shm(monkeypatch, 0)
    argv = ["--features", str(tmp_path / "missing"), "--verifier", str(tiny_verifier_dir), "--output-dir",
            str(tmp_path / "run"), "--dataloader-num-workers", "2", *flags]
    assert run_script(argv) == 1
    err = capsys.readouterr().err
    assert "/dev/shm" not in err and "missing" in err  # stopped by the missing features, not by /dev/shm
