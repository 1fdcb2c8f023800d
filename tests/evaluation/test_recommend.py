"""The one recommendation: a tree over the chain only when the speedup intervals separate; otherwise by τ per
verified token; with a verify-cost table, by the speedup predicted for that machine."""

from __future__ import annotations

import json
import random

import pytest

from eagle3_hf.evaluation.recommend import (
    load_verify_costs,
    predicted_speedup,
    recommend,
    sglang_flags,
    speedup_interval,
)


def _timings(speedup: float, noise: float, n: int = 40, seed: int = 0) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    plain = [rng.uniform(1.0, 3.0) for _ in range(n)]
    return plain, [p / speedup * rng.uniform(1 - noise, 1 + noise) for p in plain]


def _row(steps, topk, n, tau, timings=None):
    row = {"steps": steps, "topk": topk, "num_draft_tokens": n, "acceptance_length": tau}
    if timings is not None:
        plain, spec = timings
        row["speedup"] = sum(plain) / sum(spec)
        row["speedup_low"], row["speedup_high"] = speedup_interval(plain, spec)
    return row


def test_the_interval_holds_the_true_speedup_and_narrows_with_less_noise():
    low, high = speedup_interval(*_timings(1.5, 0.05))
    assert low < 1.5 < high and high - low < 0.1
    wide_low, wide_high = speedup_interval(*_timings(1.5, 0.4))
    assert wide_high - wide_low > 2 * (high - low)
    with pytest.raises(ValueError, match="no timed prompt"):
        speedup_interval([], [])


def test_a_tree_is_recommended_only_when_its_interval_clears_the_chain():
    chain = _row(3, 1, 4, 1.6, _timings(1.10, 0.05, seed=1))
    fast_tree = _row(3, 4, 8, 1.9, _timings(1.40, 0.05, seed=2))
    rec = recommend([chain, fast_tree])
    assert (rec.steps, rec.topk, rec.num_draft_tokens, rec.basis) == (3, 4, 8, "measured")
    # the same point estimate for the tree, but noisy: the intervals overlap, and the chain (which pays) stays
    noisy_tree = _row(3, 4, 8, 1.9, _timings(1.25, 0.6, seed=3))
    assert noisy_tree["speedup"] > chain["speedup"] and noisy_tree["speedup_low"] < chain["speedup_high"]
    rec = recommend([chain, noisy_tree])
    assert (rec.topk, rec.basis) == (1, "measured")


def test_when_nothing_pays_measurably_the_choice_is_by_tau_per_verified_token():
    rows = [_row(3, 1, 4, 1.5, _timings(0.95, 0.3, seed=4)), _row(2, 1, 3, 1.4, _timings(1.0, 0.3, seed=5)),
            _row(3, 4, 8, 1.9, _timings(1.02, 0.3, seed=6))]
    rec = recommend(rows)
    assert rec.basis == "tau_per_verified_token" and "no configuration beats the chain" in rec.reason
    assert (rec.steps, rec.num_draft_tokens) == (2, 3)  # 1.4 / 3 beats 1.5 / 4 and 1.9 / 8


def test_a_flat_verify_cost_favours_the_tree_and_a_linear_one_the_chain():
    rows = [_row(3, 1, 4, 1.6), _row(3, 4, 16, 2.3)]
    gpu = {"verify": {4: 1.02, 16: 1.08}, "draft": {1: 0.05, 4: 0.06}, "update": 0.05, "device": "gpu",
           "source": "g.json"}
    cpu = {"verify": {4: 2.5, 16: 8.0}, "draft": {1: 0.1, 4: 0.3}, "update": 0.2, "device": "cpu", "source": "c.json"}
    assert predicted_speedup(2.3, 3, 4, 16, gpu) == pytest.approx(2.3 / (1.08 + 2 * 0.06 + 0.05))
    assert (recommend(rows, gpu).topk, recommend(rows, gpu).basis) == (4, "predicted")
    assert recommend(rows, cpu).topk == 1
    assert predicted_speedup(2.0, 3, 8, 32, gpu) is None  # not in the table: no prediction


def test_tree_flags_name_a_backend_that_serves_trees():
    assert "--attention-backend" not in sglang_flags({"steps": 3, "topk": 1, "num_draft_tokens": 4})
    tree = {"steps": 3, "topk": 4, "num_draft_tokens": 8}
    assert sglang_flags(tree).endswith("--speculative-num-draft-tokens 8 --attention-backend flashinfer")
    assert sglang_flags(tree, mla=True).endswith("--attention-backend fa3")  # FlashInfer MLA refuses topk > 1


def test_a_bad_cost_table_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "costs.json"
    bad.write_text(json.dumps({"verify": {"4": 1.0}}))
    with pytest.raises(ValueError, match=r"costs\.json: not a verify-cost table"):
        load_verify_costs(bad)
    with pytest.raises(ValueError, match="no such verify-cost file"):
        load_verify_costs(tmp_path / "missing.json")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"verify": {"4": 1.1}, "draft": {"1": 0.1}, "update": 0.1, "device": "H200"}))
    assert load_verify_costs(good)["verify"] == {4: 1.1}
