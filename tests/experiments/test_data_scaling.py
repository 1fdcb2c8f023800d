"""experiments/data_scaling.py's extrapolation: the gain per doubling and the tokens a τ would need."""

from __future__ import annotations

import math


def test_extrapolation_recovers_the_gain_per_doubling_and_the_tokens_a_tau_needs():
    from experiments.data_scaling import extrapolation, per_doubling

    # real τ = 0.4 + 0.05 log2(tokens), simulated τ = 0.12 per doubling; the smallest point is off the line
    tokens = [3_000, 10_000, 20_000, 40_000, 80_000]
    rows = [{"tokens": t, "real_tau": 0.4 + 0.05 * math.log2(t), "sim_tau": 0.12 * math.log2(t)} for t in tokens]
    rows[0]["real_tau"] = 5.0
    a, b = per_doubling(tokens[1:], [r["real_tau"] for r in rows[1:]])
    assert math.isclose(b, 0.05) and math.isclose(a, 0.4)
    text = extrapolation(rows)  # fits the largest 4 points only
    assert "+0.050" in text and "+0.120" in text
    assert f"{2 ** ((1.5 - 0.4) / 0.05):,.0f}" in text  # τ 1.5 at 2^22 tokens on this line
    slow = [{"tokens": t, "real_tau": 1.0 + 1e-4 * math.log2(t), "sim_tau": 1.3} for t in tokens]
    assert "more than 10^18" in extrapolation(slow)  # a tiny gain: a bound, not an overflow
    flat = [{"tokens": t, "real_tau": 1.2, "sim_tau": 1.3} for t in tokens]
    assert "would need" not in extrapolation(flat)  # no gain: no promise of a token count
