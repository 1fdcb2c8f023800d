"""NaN/Inf never trains into a checkpoint nor passes as a result: a shard whose checksums are valid but whose
features are not finite stops `train` naming the sample and shard; a non-finite loss stops training; the
Trainer refuses to save non-finite weights; `evaluate` refuses them; `check` reports only the true finding."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eagle3_hf import Eagle3Config, Eagle3DraftModel, cli
from eagle3_hf.data.vocab import load_vocab
from eagle3_hf.features.packing import PackedCollator, PackedDataset
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.store import MANIFEST, sample_sha256, sha256_file
from eagle3_hf.train.arguments import Eagle3TrainingArguments
from eagle3_hf.train.trainer import Eagle3Trainer

from tests.helpers.data import FINGERPRINT, SYN_VOCAB, synthetic_data

COMMON = ["--max-seq-len", "128", "--per-device-train-batch-size", "2", "--disable-tqdm", "true",
          "--num-train-epochs", "1", "--validation-fraction", "0.2", "--eval-strategy", "no", "--save-strategy",
          "steps", "--save-steps", "1", "--report-to", "none"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """tests/conftest.py's `synthetic` at 24 samples."""
    return synthetic_data(tmp_path_factory.mktemp("nonfinite"), num_samples=24)


def poison(features, out, value=float("nan")) -> tuple[str, str]:
    """Copy a feature directory and overwrite one training sample's features, with checksums made valid again
    (as a faulty extraction or an import would write them). Returns (sample id, shard file name)."""
    shutil.copytree(features, out)
    ds = FeatureDataset(out, "train", 0.2)
    index = len(ds) // 2
    sample_id = ds.sample_ids[index]
    path, offset, count = ds.byte_ranges(index)[3]  # aux_hidden_states (SAMPLE_KEYS order)
    assert ds._layout[ds._samples[index]["shard"]][3][0] == "aux_hidden_states"
    with open(path, "r+b") as f:
        f.seek(offset + count // 2)
        f.write(torch.full((4,), value).numpy().tobytes())
    manifest = json.loads((out / MANIFEST).read_text())
    shard = next(s for s in manifest["shards"] if s["file"] == path.name)
    shard["sha256"] = sha256_file(path)
    fresh = FeatureDataset(out, "all", verify="none")
    by_id = {sid: fresh.raw(i) for i, sid in enumerate(fresh.sample_ids)}
    for s in manifest["samples"]:
        s["sha256"] = sample_sha256(by_id[s["id"]])
    (out / MANIFEST).write_text(json.dumps(manifest))
    FeatureDataset(out, "all", verify="shard")  # the checksums are valid
    return sample_id, path.name


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_rows_with_valid_checksums_stop_train_naming_sample_and_shard(synthetic, tmp_path, capsys,
                                                                                 value):
    sample_id, shard = poison(synthetic["features"], tmp_path / "features", value)
    out = tmp_path / "run"
    rc = cli.main(["train", "--verifier", str(synthetic["verifier_dir"]), "--features", str(tmp_path / "features"),
                   "--output-dir", str(out), *COMMON])
    assert rc != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and sample_id in last and shard in last and "NaN/Inf" in last
    assert not list(out.rglob("model.safetensors"))  # neither the final model nor a checkpoint


def trainer_for(synthetic, tmp_path, **overrides) -> Eagle3Trainer:
    verifier = synthetic["verifier"]
    d2t, t2d, _ = load_vocab(synthetic["features"] / "vocab.safetensors", FINGERPRINT, SYN_VOCAB)
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=d2t.numel(),
                                        aux_hidden_state_indices=[1, 3, 4])
    torch.manual_seed(0)
    model = Eagle3DraftModel(config)
    model.set_vocab_mapping(d2t, t2d)
    model.load_verifier_embeddings(verifier)
    model.attach_teacher(verifier)
    args = Eagle3TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none",
                                   per_device_train_batch_size=2, max_steps=3, logging_steps=1, save_strategy="steps",
                                   save_steps=1, disable_tqdm=True, **overrides)
    train = PackedDataset(FeatureDataset(synthetic["features"], "train", 0.2), 128)
    return Eagle3Trainer(model=model, args=args, train_dataset=train, data_collator=PackedCollator(max_seq_len=128))


def test_non_finite_loss_stops_training_before_any_checkpoint(synthetic, tmp_path):
    trainer = trainer_for(synthetic, tmp_path)
    assert trainer.args.logging_nan_inf_filter is False  # a logged loss never averages a NaN away
    with torch.no_grad():
        trainer.model.fc.weight[0, 0] = float("nan")
    from eagle3_hf.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="non-finite training loss .* at step 1"):
        trainer.train()
    assert not list((tmp_path / "run").rglob("model.safetensors"))


def test_trainer_never_saves_non_finite_weights(synthetic, tmp_path):
    trainer = trainer_for(synthetic, tmp_path)
    with torch.no_grad():
        trainer.model.lm_head.weight[3] = float("inf")
    from eagle3_hf.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match="lm_head.weight"):
        trainer.save_model(str(tmp_path / "final"))
    assert not (tmp_path / "final" / "model.safetensors").exists()


def test_evaluate_refuses_a_non_finite_drafter(tmp_path, tiny_verifier_dir, capsys):
    from eagle3_hf.verifier.loading import load_verifier

    from tests.helpers.drafters import random_drafter

    drafter = random_drafter(load_verifier(str(tiny_verifier_dir)), draft_vocab_size=300)
    with torch.no_grad():
        for p in drafter.parameters():
            p.fill_(float("nan"))
    drafter.save_pretrained(tmp_path / "nan", safe_serialization=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "Name a color."}\n')
    rc = cli.main(["evaluate", "--drafter", str(tmp_path / "nan"), "--verifier", str(tiny_verifier_dir), "--prompts",
                   str(prompts), "--k", "2", "--max-new-tokens", "4", "--output", str(tmp_path / "eval"),
                   "--no-progress", "--device", "cpu"])
    assert rc != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "tensor(s) contain NaN/Inf (fc.weight" in last
    assert not (tmp_path / "eval" / "eagle3_evaluation.json").exists()


def test_check_on_an_all_nan_lm_head_reports_only_that(tmp_path):
    from eagle3_hf.publish.check import check_drafter

    from tests.helpers.drafters import DRAFT_VOCAB, HIDDEN, write_drafter

    nan_head = torch.full((DRAFT_VOCAB, HIDDEN), float("nan"))
    findings = check_drafter(write_drafter(tmp_path / "d", replace={"lm_head.weight": nan_head}))
    assert [(f.level, f.code) for f in findings] == [("error", "non-finite")]
    assert "lm_head.weight" in findings[0].message
