"""Acceptance statistics and the lossless check: what the per-step records of a decoder (result.py) amount to.
The same numbers as the `evaluate` metric module (evaluation/metrics/acceptance)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

TIE_MARGIN = 1e-4  # docs/contracts.md "Metrics": top-2 fp32 logits closer than this are a numerical tie


def acceptance_metric_path() -> str:
    """Directory of the `evaluate` metric module, for `evaluate.load(acceptance_metric_path())`."""
    return str(Path(__file__).resolve().parents[1] / "evaluation" / "metrics" / "acceptance")


def acceptance_stats(accepted: Sequence[int], drafted: Sequence[int], k: int | None = None) -> dict[str, Any]:
    """τ, per-position acceptance and histogram from per-verify-step records (same as the metric module).

    τ = mean(accepted + 1). Position j's acceptance is unconditional: the share of steps that drafted at
    least j tokens in which the first j were all accepted.
    """
    k = int(k if k is not None else max(drafted, default=0))
    steps, per_position = len(accepted), []
    for j in range(1, k + 1):
        offered = sum(1 for d in drafted if d >= j)
        hits = sum(1 for a, d in zip(accepted, drafted) if d >= j and a >= j)
        per_position.append(hits / offered if offered else None)
    histogram = [list(accepted).count(j) for j in range(k + 1)]
    return {
        "acceptance_length": (sum(accepted) + steps) / steps if steps else None,
        "per_position_acceptance": per_position,
        "accepted_histogram": histogram,
        "num_steps": steps,
    }


def compare_to_greedy(tokens: Sequence[int], margins: Sequence[float], ref_tokens: Sequence[int],
                      ref_margins: Sequence[float], tie_margin: float = TIE_MARGIN) -> tuple[str, int | None]:
    """-> ("match" | "tie" | "mismatch", first differing index). A divergence where either run saw the
    verifier's top-2 logits within `tie_margin` is a numerical tie; the rest of that sample is not compared."""
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:
            return ("tie" if min(margins[i], ref_margins[i]) < tie_margin else "mismatch"), i
    if len(tokens) != len(ref_tokens):
        return "mismatch", min(len(tokens), len(ref_tokens))
    return "match", None
