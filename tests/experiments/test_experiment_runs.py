"""The experiments' shared pieces: prompt-set specs, the sweep's choice of each side's best learning rate on the
development set (never the test set), and the data-scaling prediction that leaves its largest point out."""

from __future__ import annotations

import math

import pytest


def test_eval_set_specs_parse_and_a_bad_one_names_itself():
    from experiments.runs import parse_eval_sets

    assert parse_eval_sets(["dev=40", "mt-bench=0"]) == [("dev", 40), ("mt-bench", 0)]
    with pytest.raises(SystemExit, match="'mt-bench'"):
        parse_eval_sets(["mt-bench"])


def _row(dev_tau: float, sim_tau: float, test_tau: float) -> dict:
    return {"eval": {"dev=40": {"acceptance_length": dev_tau}}, "validation": {"simulated_acceptance_length": sim_tau},
            "test": test_tau}


def test_each_side_keeps_its_best_development_lr_and_its_default():
    from experiments.speculators_lr_sweep import pick_lrs

    by_lr = {  # ours peaks at 4e-3 on dev, speculators at 8e-3; the test column would choose otherwise
        1e-3: {"results": {"ours": _row(1.10, 1.20, 1.30), "speculators": _row(1.05, 1.10, 1.30)}},
        2e-3: {"results": {"ours": _row(1.15, 1.25, 1.00), "speculators": _row(1.07, 1.12, 1.00)}},
        4e-3: {"results": {"ours": _row(1.20, 1.22, 1.00), "speculators": _row(1.07, 1.15, 1.00)}},
        8e-3: {"results": {"ours": _row(1.12, 1.30, 1.00), "speculators": _row(1.09, 1.05, 1.00)}},
    }
    picks = pick_lrs(by_lr)
    assert picks == {"ours": {"best": 4e-3, "default": 2e-3}, "speculators": {"best": 8e-3, "default": 1e-3}}
    by_lr[8e-3]["results"]["speculators"] = _row(1.07, 1.05, 1.00)  # a dev tie: simulated τ decides
    assert pick_lrs(by_lr)["speculators"]["best"] == 4e-3


def test_the_prediction_fits_below_the_largest_point_and_sets_it_against_the_measurement():
    from experiments.data_scaling import prediction

    tokens = [12_800, 25_600, 51_200, 204_800]  # on the line τ = 0.5 + 0.05 log2(t) except the largest
    rows = [{"tokens": t, "sim_tau": 0.1 * math.log2(t), "real_tau:mt-bench": 0.5 + 0.05 * math.log2(t),
             "eval_sets": ["mt-bench"]} for t in tokens]
    rows[-1]["real_tau:mt-bench"] = 1.0
    text = prediction(rows)
    assert f"| real (mt-bench) | {0.5 + 0.05 * math.log2(204_800):.3f} | 1.000 |" in text
    assert f"| simulated (validation) | {0.1 * math.log2(204_800):.3f} |" in text
