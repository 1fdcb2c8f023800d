"""`train --drafter-kind dflash`: the Trainer trains a DFlash drafter on the same features as EAGLE-3, logs its
per-block-position metrics under the same names, saves the served layout, and refuses a mask token the data has."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eagle3_hf.errors import UsageError
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.model.dflash_checkpoint import expected_dflash_shapes
from eagle3_hf.model.modeling_dflash import DFlashDraftModel
from eagle3_hf.scripts.train import main as train_main
from eagle3_hf.train.dflash_setup import choose_mask_token, tokens_present

from tests.helpers.data import COMMON, SYN_VOCAB

BLOCK = ["--drafter-kind", "dflash", "--block-size", "4", "--dflash-layers", "2", "--dflash-anchors", "64"]


def absent_token(features) -> int:
    present = tokens_present([FeatureDataset(features, "all", verify="none")], SYN_VOCAB)
    return int((~present).nonzero()[-1])


def test_dflash_training_learns_the_first_block_position_and_saves_the_served_layout(synthetic, tmp_path):
    """The synthetic verifier's greedy token after x is x + 1: block position 1 (the token after the anchor) is
    learnable, though slowly by a drafter whose head is the verifier's frozen one; later positions follow a random
    walk. The loss falls, held-out accuracy at position 1 rises above chance, τ is simulated over the 3 positions."""
    out = tmp_path / "run"
    mask = absent_token(synthetic["features"])
    summary = train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
                          "--output-dir", str(out), "--num-train-epochs", "40", "--validation-fraction", "0.2",
                          "--warmup-steps", "3", "--save-strategy", "no", "--eval-strategy", "no",
                          "--mask-token-id", str(mask), *BLOCK, *COMMON, "--learning-rate", "3e-3"])
    train_logs = [h for h in summary["log_history"] if "acc_0" in h]
    assert train_logs[0]["loss"] > 5 * train_logs[-1]["loss"] and train_logs[0]["acc_0"] < 0.05
    logged = set(train_logs[-1])
    assert {"acc_2", "cond_acc_2", "simulated_acceptance_length"} <= logged and "acc_3" not in logged
    assert summary["recipe"]["drafter_kind"] == "dflash" and summary["recipe"]["mask_token_id"] == mask
    metrics = summary["metrics"]
    assert len(metrics["step_accuracy"]) == 3 and metrics["step_accuracy"][0] > 0.1  # chance: 1 in 256
    assert metrics["simulated_acceptance_length"] == pytest.approx(
        1 + sum(math.prod(metrics["step_conditional_accuracy"][: k + 1]) for k in range(3)))
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"]["mask_token_id"] == mask
    assert raw["dflash_config"]["target_layer_ids"] == [i - 1 for i in FeatureDataset(
        synthetic["features"], "all", verify="none").aux_layer_indices]
    saved = DFlashDraftModel.from_pretrained(out, verifier=synthetic["verifier"])
    assert set(saved.state_dict()) - {"embed_tokens.weight", "lm_head.weight"} == set(expected_dflash_shapes(raw))


def test_a_mask_token_the_data_contains_is_refused(synthetic, tmp_path):
    present = tokens_present([FeatureDataset(synthetic["features"], "all", verify="none")], SYN_VOCAB)
    used = int(present.nonzero()[0])
    with pytest.raises(UsageError, match=f"--mask-token-id {used} occurs in the training data"):
        train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
                    "--output-dir", str(tmp_path / "run"), "--mask-token-id", str(used), *BLOCK, *COMMON])


class Tokenizer:
    eos_token_id, bos_token_id, pad_token_id = 1, 0, 0
    all_special_ids = [0, 1, 5, 9]
    added_tokens_decoder = {9: "<a>", 12: "<b>"}


def test_the_default_mask_token_is_the_highest_unused_special_token():
    present = torch.zeros(16, dtype=torch.bool)
    present[[2, 3, 12]] = True
    assert choose_mask_token(Tokenizer(), present) == 9  # 12 is in the data, 0 and 1 are bos/eos
    present[[5, 9]] = True
    with pytest.raises(UsageError, match="pass --mask-token-id"):
        choose_mask_token(Tokenizer(), present)
    assert choose_mask_token(Tokenizer(), present, requested=15) == 15


def test_the_trainer_normalises_by_the_anchors_of_the_whole_optimizer_step(tmp_path):
    """Each micro-batch's anchors are drawn where the Trainer counts num_items_in_batch, and the loss of a
    micro-batch is its weighted sum over that count (not its own anchors): packing and accumulation don't change it."""
    from transformers import LlamaConfig

    from eagle3_hf.model.configuration_dflash import DFlashConfig
    from eagle3_hf.train.arguments import Eagle3TrainingArguments
    from eagle3_hf.train.dflash_loss import ANCHORS_KEY, dflash_loss
    from eagle3_hf.train.trainer import Eagle3Trainer

    vocab, hidden = 61, 32
    config = DFlashConfig.from_verifier(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                                                    num_hidden_layers=6, num_attention_heads=2,
                                                    num_key_value_heads=1), mask_token_id=vocab - 1,
                                        num_hidden_layers=1, block_size=3)
    torch.manual_seed(0)
    model = DFlashDraftModel(config)
    model.load_verifier_weights(torch.randn(vocab, hidden), torch.randn(vocab, hidden))
    model.anchors_per_row = 5
    args = Eagle3TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = Eagle3Trainer(model=model, args=args)

    def batch(length: int, seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {"input_ids": torch.randint(0, vocab - 1, (1, length), generator=g),
                "aux_hidden_states": torch.randn(1, length, 3 * hidden, generator=g),
                "last_hidden_state": torch.randn(1, length, hidden, generator=g),
                "verifier_greedy": torch.randint(0, vocab - 1, (1, length), generator=g),
                "position_ids": torch.arange(length)[None], "document_ids": torch.zeros(1, length, dtype=torch.long),
                "loss_mask": torch.ones(1, length, dtype=torch.long)}

    batches = [batch(12, 0), batch(4, 1)]  # 5 anchors, then fewer: the second row has 2 candidates
    count = trainer._get_num_items_in_batch(batches, torch.device("cpu"))
    assert int(count) == 5 + 2 == sum(int((b[ANCHORS_KEY] >= 0).sum()) for b in batches)
    model.train()
    loss = trainer.compute_loss(model, batches[1], num_items_in_batch=count)
    own = dflash_loss(model, batches[1])
    assert own.total is not None
    torch.testing.assert_close(loss, own.total / 7)
