"""The training script's defaults are the recipe's: the best checkpoint by simulated τ wherever there is a
validation split, and every shipped recipe file parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_hf.train.arguments import parse_args

ROOT = Path(__file__).resolve().parents[2]


def training_args(*argv: str):
    return parse_args(["--output-dir", "runs/x", *argv])[2]


def test_best_checkpoint_by_simulated_tau_is_the_default():
    args = training_args()
    assert args.load_best_model_at_end and args.metric_for_best_model == "simulated_acceptance_length"
    assert args.greater_is_better and args.eval_strategy == args.save_strategy == "epoch"


@pytest.mark.parametrize("argv", [["--eval-strategy", "no"], ["--eval-strategy", "steps", "--save-strategy", "epoch"],
                                  ["--eval-strategy", "steps", "--eval-steps", "30", "--save-strategy", "steps",
                                   "--save-steps", "40"], ["--load-best-model-at-end", "false"]])
def test_off_where_no_checkpoint_matches_an_evaluation_or_when_asked(argv):
    assert training_args(*argv).load_best_model_at_end is False


@pytest.mark.parametrize("recipe", sorted((ROOT / "examples" / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_parses_and_keeps_the_best_checkpoint(recipe):
    args = training_args("--config", str(recipe), "--deepspeed", "")  # DeepSpeed's config is not needed to parse
    assert args.load_best_model_at_end and args.metric_for_best_model == "simulated_acceptance_length"
    assert "Where the numbers come from" in recipe.read_text()


def test_the_demo_recipe_is_the_one_chosen_by_measurement():
    args = training_args("--config", str(ROOT / "examples" / "recipes" / "small_cpu.yaml"))
    assert (args.learning_rate, args.lr_scheduler_type, args.num_train_epochs) == (2e-3, "cosine", 6)
    data = parse_args(["--output-dir", "x", "--config", str(ROOT / "examples" / "recipes" / "small_cpu.yaml")])[1]
    assert data.max_seq_len == 256
