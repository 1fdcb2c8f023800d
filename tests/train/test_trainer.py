"""Eagle3Trainer: the loss against a reference, learning, accelerate/DeepSpeed launches, kill-and-resume,
finetune-from with another vocabulary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.data.vocab import load_vocab, vocab_from_target_ids
from eagle3_hf.features.packing import PackedCollator, PackedDataset
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.scripts.train import main as train_main
from eagle3_hf.train.arguments import Eagle3TrainingArguments
from eagle3_hf.train.metrics import drafter_step_accuracies
from eagle3_hf.train.trainer import Eagle3Trainer

from tests.helpers.data import COMMON, FINGERPRINT, SYN_VOCAB
from tests.helpers.drafters import STANDARD_KEYS

ROOT = Path(__file__).resolve().parents[2]


def fresh_drafter(synthetic, seed: int = 0, aux=(1, 3, 4)) -> Eagle3DraftModel:
    torch.manual_seed(seed)
    verifier = synthetic["verifier"]
    d2t, t2d, _ = load_vocab(synthetic["features"] / "vocab.safetensors", FINGERPRINT, SYN_VOCAB)
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=d2t.numel(),
                                        aux_hidden_state_indices=list(aux))
    config._attn_implementation = "sdpa"
    model = Eagle3DraftModel(config)
    model.set_vocab_mapping(d2t, t2d)
    model.load_verifier_embeddings(verifier)
    model.attach_teacher(verifier)
    return model


def a_batch(features, rows=2):
    packed = PackedDataset(FeatureDataset(features, split="all"), 128, seed=None)
    return PackedCollator(max_seq_len=128)([packed[i] for i in range(rows)])


def reference_loss(model, verifier, batch, steps=3, gamma=0.8):
    """Plain loops: teacher = softmax of the verifier's full logits over the kept ids (restricted and
    renormalised), loss where token t+2+i is an assistant token of t's document and greedy is kept."""
    kept = torch.nonzero(model.t2d).flatten()
    full = verifier.lm_head(batch["last_hidden_state"])  # [B, L, V]
    out = model(batch["input_ids"], batch["aux_hidden_states"], batch["position_ids"], batch["document_ids"],
                ttt_steps=steps)
    doc, mask, greedy = batch["document_ids"], batch["loss_mask"], batch["verifier_greedy"]
    total, count = 0.0, 0
    B, L = doc.shape
    for i in range(steps):
        for b in range(B):
            for t in range(L):
                p = t + 2 + i
                if doc[b, t] < 0 or p >= L or doc[b, p] != doc[b, t] or not mask[b, p]:
                    continue
                if not model.t2d[greedy[b, t + 1 + i]]:
                    continue
                teacher = torch.softmax(full[b, t + 1 + i, kept], dim=-1)
                student = torch.log_softmax(out.logits[i][b, t], dim=-1)
                total += gamma**i * float(-(teacher * student).sum())
                count += i == 0
    return total / count


def test_loss_equals_reference(synthetic, tmp_path):
    model = fresh_drafter(synthetic)
    args = Eagle3TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = Eagle3Trainer(model=model, args=args)
    batch = a_batch(synthetic["features"])
    model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        expected = reference_loss(model, synthetic["verifier"], batch)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_ttt_settings_of_the_run_are_the_drafters(synthetic, tmp_path):
    """--ttt-steps / --ttt-step-weight are recorded in the drafter's config, which drafter_step_accuracies
    and the speculators export read: a run with gamma 0.5 must not be measured or described with 0.8."""
    model = fresh_drafter(synthetic)
    args = Eagle3TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", ttt_steps=2,
                                   ttt_step_weight=0.5)
    trainer = Eagle3Trainer(model=model, args=args)
    assert (model.config.ttt_steps, model.config.ttt_step_weight) == (2, 0.5)
    trainer.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (saved["ttt_steps"], saved["ttt_step_weight"]) == (2, 0.5)


def test_training_drives_step_accuracies_up(synthetic, tmp_path):
    out = tmp_path / "run"
    summary = train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
                          "--output-dir", str(out), "--num-train-epochs", "16", "--validation-fraction", "0.2",
                          "--warmup-steps", "5", "--save-strategy", "no", "--eval-strategy", "no", *COMMON])
    train_logs = [h for h in summary["log_history"] if "acc_0" in h]
    assert train_logs[0]["acc_0"] < 0.3
    assert train_logs[-1]["acc_0"] > 0.9 and train_logs[-1]["cond_acc_2"] > 0.8
    metrics = summary["metrics"]
    assert metrics["step_accuracy"][0] > 0.5 and metrics["simulated_acceptance_length"] > 2.0
    saved = Eagle3DraftModel.from_pretrained(out, verifier=synthetic["verifier"])
    saved.attach_teacher(synthetic["verifier"])
    again = drafter_step_accuracies(saved, FeatureDataset(synthetic["features"], "validation", 0.2), 128)
    assert again["acc_0"] == pytest.approx(metrics["step_accuracy"][0], abs=1e-6)


def _launch(synthetic, out: Path, extra: list[str], port: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs/cpu_2proc.yaml"), "--main_process_port", str(port),
           str(ROOT / "examples/train.py"), "--verifier", str(synthetic["verifier_dir"]),
           "--features", str(synthetic["features"]), "--output-dir", str(out), "--num-train-epochs", "2",
           "--validation-fraction", "0.2", *COMMON, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("mode,port", [("ddp", 29611), ("zero2", 29612), ("zero3", 29613)])
def test_accelerate_launch_two_cpu_processes(synthetic, tmp_path, mode, port):
    extra = [] if mode == "ddp" else ["--deepspeed", str(ROOT / f"ds_configs/{mode}.json")]
    out = tmp_path / mode
    result = _launch(synthetic, out, extra, port)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "eagle3_training.json").read_text())
    assert summary["data"]["num_train_rows"] > 0
    steps_per_epoch = [h["step"] for h in summary["log_history"] if "eval_loss" in h]
    rows = summary["data"]["num_train_rows"]
    assert steps_per_epoch[0] == -(-rows // 4)  # 2 processes x 2 rows: really data parallel
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == STANDARD_KEYS
    final_eval = [h for h in summary["log_history"] if "eval_loss_0" in h][-1]
    model = Eagle3DraftModel.from_pretrained(out, verifier=synthetic["verifier"])
    model.attach_teacher(synthetic["verifier"])
    metrics = drafter_step_accuracies(model, FeatureDataset(synthetic["features"], "validation", 0.2), 128)
    for i in range(3):  # the saved weights reproduce the in-memory model's evaluation
        assert metrics[f"loss_{i}"] == pytest.approx(final_eval[f"eval_loss_{i}"], rel=1e-4)
        assert metrics[f"acc_{i}"] == pytest.approx(final_eval[f"eval_acc_{i}"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)  # 152 s measured (README, Development)
def test_sigkill_and_resume_matches_uninterrupted_run(synthetic, tmp_path):
    args = ["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
            "--num-train-epochs", "4", "--validation-fraction", "0.2", "--save-strategy", "steps",
            "--save-steps", "2", "--save-total-limit", "10", "--eval-strategy", "no", *COMMON]
    script = str(ROOT / "examples/train.py")
    full = tmp_path / "full"
    subprocess.run([sys.executable, script, *args, "--output-dir", str(full)], check=True, capture_output=True,
                   timeout=600, cwd=ROOT)
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, script, *args, "--output-dir", str(killed)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.time() + 300
    while time.time() < deadline and not (killed / "checkpoint-6" / "trainer_state.json").exists():
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = sorted((p for p in killed.glob("checkpoint-*") if (p / "trainer_state.json").exists()),
                      key=lambda p: int(p.name.split("-")[1]))
    assert complete, "no checkpoint was written before the kill"
    subprocess.run([sys.executable, script, *args, "--output-dir", str(killed), "--resume-from-checkpoint",
                    str(complete[-1])], check=True, capture_output=True, timeout=600, cwd=ROOT)
    a = json.loads((full / "eagle3_training.json").read_text())["metrics"]
    b = json.loads((killed / "eagle3_training.json").read_text())["metrics"]
    # tolerance: float32 summation order is identical on one CPU process, so results agree to 1e-6
    for key in ("step_accuracy", "step_conditional_accuracy"):
        assert b[key] == pytest.approx(a[key], abs=1e-6)
    assert b["simulated_acceptance_length"] == pytest.approx(a["simulated_acceptance_length"], abs=1e-6)
    with safe_open(str(full / "model.safetensors"), framework="pt") as fa, \
            safe_open(str(killed / "model.safetensors"), framework="pt") as fb:
        for key in fa.keys():
            torch.testing.assert_close(fa.get_tensor(key), fb.get_tensor(key), atol=1e-6, rtol=1e-5)


def test_remapped_vocabulary_keeps_predictions_aligned(synthetic):
    source = fresh_drafter(synthetic, seed=3)
    batch = a_batch(synthetic["features"], rows=1)
    with torch.no_grad():
        before = source(batch["input_ids"], batch["aux_hidden_states"], batch["position_ids"],
                        batch["document_ids"]).logits[0]
    old_targets = source.draft_to_target(torch.arange(source.config.draft_vocab_size))
    # a different mapping: half of the old ids, plus ids the source never drafted
    new_ids = torch.sort(torch.cat([old_targets[::2], torch.arange(200, 240)])).values.unique()
    d2t, t2d = vocab_from_target_ids(new_ids, SYN_VOCAB)
    naive = fresh_drafter(synthetic, seed=3)
    remapped = fresh_drafter(synthetic, seed=3)
    carried = remapped.remap_lm_head(d2t, t2d)
    assert carried == len(old_targets[::2])
    naive.lm_head = torch.nn.Linear(naive.config.hidden_size, len(new_ids), bias=False)
    naive.lm_head.weight.data.copy_(source.lm_head.weight.data[: len(new_ids)])  # rows kept by position
    naive.config.draft_vocab_size = len(new_ids)
    naive.register_buffer("d2t", torch.zeros(len(new_ids), dtype=torch.long))
    naive.set_vocab_mapping(d2t, t2d)
    with torch.no_grad():
        after = remapped(batch["input_ids"], batch["aux_hidden_states"], batch["position_ids"],
                         batch["document_ids"]).logits[0]
        wrong = naive(batch["input_ids"], batch["aux_hidden_states"], batch["position_ids"],
                      batch["document_ids"]).logits[0]
    old_row = {int(t): i for i, t in enumerate(old_targets)}
    new_targets = remapped.draft_to_target(torch.arange(len(new_ids)))
    pairs = [(old_row[int(t)], j) for j, t in enumerate(new_targets) if int(t) in old_row]
    old_cols, new_cols = zip(*pairs)
    torch.testing.assert_close(after[..., list(new_cols)], before[..., list(old_cols)])
    assert not torch.allclose(wrong[..., list(new_cols)], before[..., list(old_cols)])


def test_finetune_from_mismatched_source_warns_and_reports_source_accuracy(synthetic, tmp_path):
    source = fresh_drafter(synthetic, seed=5, aux=(2, 3, 5))  # trained for other aux layers
    source.config.verifier_name_or_path = "another-verifier"
    source.save_pretrained(tmp_path / "source")
    summary = train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
                          "--output-dir", str(tmp_path / "ft"), "--finetune-from", str(tmp_path / "source"),
                          "--num-train-epochs", "1", "--validation-fraction", "0.2", "--save-strategy", "no",
                          "--eval-strategy", "no", *COMMON])
    init = summary["init"]
    assert any("aux layers" in w for w in init["warnings"]) and any("another-verifier" in w for w in init["warnings"])
    assert "source_acc_0" in init["source_metrics"]
    with safe_open(str(tmp_path / "ft" / "model.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("d2t"), source.d2t)  # the source's mapping was kept
    config = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # now reads the data's layers


def test_online_mode_trains_with_nothing_on_disk(synthetic, tmp_path):
    """--features hf: the verifier produces each batch's features in the training process; no shards."""
    summary = train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", "hf", "--prepared-dir",
                          str(synthetic["root"] / "prepared"), "--vocab",
                          str(synthetic["features"] / "vocab.safetensors"), "--output-dir", str(tmp_path / "online"),
                          "--num-train-epochs", "8", "--validation-fraction", "0.2", "--save-strategy", "no",
                          "--eval-strategy", "no", "--logging-steps", "4", *COMMON])
    assert summary["recipe"]["online"] is True
    train_logs = [h for h in summary["log_history"] if "acc_0" in h]
    assert train_logs[-1]["acc_0"] > train_logs[0]["acc_0"]
    assert not list((tmp_path / "online").glob("shard-*"))
    config = json.loads((tmp_path / "online" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # the verifier's defaults, read online


def test_soft_cross_entropy_blocks_equal_plain_autograd(monkeypatch):
    """The blockwise loss (teacher softmax once, gradient without gathered copies) gives the plain formula's
    loss and gradient, whatever the block size."""
    from eagle3_hf.train import loss as step_metrics

    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 9, 13, generator=g, dtype=torch.float64).float().requires_grad_(True)
    teacher = torch.randn(2, 9, 13, generator=g) * 3
    mask = torch.rand(2, 9, generator=g) < 0.6
    mask[:, -2:] = False  # t + shift stays in the row
    rows, cols = mask.nonzero(as_tuple=True)
    plain = -(torch.softmax(teacher[rows, cols + 2], -1) * torch.log_softmax(student[rows, cols], -1)).sum()
    (expected,) = torch.autograd.grad(plain * 0.7, student)
    probs = torch.softmax(teacher, -1)
    for block_elements in (13 * 3, 1 << 23):  # 3 rows a block, one block
        monkeypatch.setattr(step_metrics, "LOSS_CHUNK_ELEMENTS", block_elements)
        loss = step_metrics.soft_cross_entropy_at(student, probs, mask, shift=2)
        (grad,) = torch.autograd.grad(loss * 0.7, student)
        torch.testing.assert_close(loss, plain.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)


def test_frozen_verifier_lm_head_stays_bit_identical_and_has_no_optimizer_state(synthetic, tmp_path):
    """--init-lm-head verifier --freeze-lm-head: the head starts as the verifier's draft rows and ends as them,
    bit for bit, while the rest trains; the summary records both options."""
    from eagle3_hf.train.trainer import training_summary

    model = fresh_drafter(synthetic)
    rows = synthetic["verifier"].lm_head.weight[model.draft_to_target(torch.arange(model.config.draft_vocab_size))]
    fc_before = model.fc.weight.detach().clone()
    args = Eagle3TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=3,
                                   learning_rate=1e-2, weight_decay=0.1, per_device_train_batch_size=2,
                                   save_strategy="no", eval_strategy="no", disable_tqdm=True,
                                   init_lm_head="verifier", freeze_lm_head=True)
    train = PackedDataset(FeatureDataset(synthetic["features"], split="all"), 128, seed=0)
    trainer = Eagle3Trainer(model=model, args=args, train_dataset=train, data_collator=PackedCollator(max_seq_len=128))
    assert torch.equal(model.lm_head.weight, rows)
    trainer.train()
    assert torch.equal(model.lm_head.weight, rows) and model.lm_head.weight.grad is None
    assert not torch.equal(model.fc.weight, fc_before)
    assert all(p is not model.lm_head.weight for group in trainer.optimizer.param_groups for p in group["params"])
    recipe = training_summary(trainer, {})["recipe"]
    assert recipe["init_lm_head"] == "verifier" and recipe["freeze_lm_head"] is True


def test_heads_on_read_positions_only_give_the_same_loss_gradient_and_metrics(synthetic):
    """The trainer computes lm_head only where the loss or the metrics read it and the teacher only where the
    loss reads it; the full-logits forward gives the same loss, gradients and step statistics."""
    from eagle3_hf.train.loss import drafter_loss
    from eagle3_hf.train.metrics import StepStats

    model = fresh_drafter(synthetic, seed=2)
    batch = a_batch(synthetic["features"])
    results = []
    for heads_where_read in (False, True):
        model.zero_grad()
        step = drafter_loss(model, batch, model.t2d, 3, 0.8, heads_where_read=heads_where_read)
        step.total.backward()
        stats = StepStats(3)
        stats.update(step.outputs.logits, batch, model.d2t, model.t2d, logits_mask=step.logits_mask)
        results.append((step.total.detach(), model.lm_head.weight.grad.clone(), model.fc.weight.grad.clone(),
                        stats.metrics()))
    (full_loss, full_head, full_fc, full_metrics), (loss, head, fc, metrics) = results
    masks = (step.logits_mask, step.outputs.teacher_mask)
    assert masks[1].sum() < masks[1].numel() and masks[0][0].sum() < masks[0][0].numel()  # rows were skipped
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head, full_head, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fc, full_fc, rtol=1e-4, atol=1e-6)
    assert metrics == full_metrics
