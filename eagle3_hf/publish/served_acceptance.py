"""Whether an engine accepts what training measured: a served drafter's per-position acceptance against the
validation conditional accuracies its training recorded (`eagle3_training.json`, metrics.step_conditional_accuracy).

Both sides are conditional rates of the same event. Training's step-i conditional accuracy is the share of
validation positions where the drafter's step-i token equals the verifier's greedy token, among those where steps
0..i-1 were right. A greedy engine accepts draft position j exactly when drafts 0..j all equal the verifier's
greedy tokens, so among the verify steps that accepted drafts 0..j-1, the share that also accepted draft j is the
same quantity, served (`ServedCounts.conditional`). A wrong aux-layer capture, other RoPE parameters, a norm the
engine skips or a wrong vocabulary mapping leaves the weights loadable and the output lossless, but lowers this
rate: the drafter sees other inputs than it was trained on.

The rule. Position j fails when the served rate is below the recorded one by more than `tolerance`, beyond
chance: the upper end of the Wilson score interval of the served counts (one-sided, at confidence
1 - ALPHA / positions compared, so the whole check errs with probability at most ALPHA when serving is right) lies
below recorded_j - tolerance. The allowance is thus two parts. The statistical one, upper - served, is the sampling
noise of the verify steps that reached the position: it shrinks as 1/sqrt(steps), so more prompts tighten the check
(55 of 100 against recorded 0.8 passes,
110 of 200 fails). The recorded side is taken as exact (a validation split holds
thousands of positions). `tolerance` (default TOLERANCE) is not sampling noise and no amount of evidence removes it:
the validation split is not the prompts sent here, and a correctly served drafter accepts somewhat less on other
text. It is the smallest drop the check is built to catch, set from the small demo (docs/results/demo.md), served
correctly by vLLM on all 80 MT-bench questions: validation 0.357 / 0.405 / 0.426, served 0.265 / 0.283 / 0.333
(gaps 0.09 / 0.12 / 0.09); a serving fault takes a position's rate most of the way to zero. A served rate above the
recorded one never fails.

Evidence first. A position is judged only when at least `needed` verify steps reached it: the larger of
`min_steps` (MIN_VERIFY_STEPS: drafts within one answer are correlated, which the binomial interval does not see,
so a handful of steps from one answer is not a sample) and the fewest steps at which even a served rate of 0 would
fail (Wilson's upper end at 0 successes, z^2 / (n + z^2), below the floor): with fewer, a pass would mean nothing.
A position whose floor is at or below 0 (recorded below the tolerance) cannot fail and is not judged. The verdict:
"fail" when a judged position fails; "pass" when every position that can fail was judged and none did; otherwise
"undecided" (`check --endpoint` says "not enough evidence: ask more prompts" and exits with its own status).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

from ..constants import TRAINING_FILE

TOLERANCE = 0.15  # served conditional acceptance may sit this far below the recorded one (module docstring)
ALPHA = 0.01  # chance of failing a correctly served drafter, over all positions compared
MIN_VERIFY_STEPS = 20  # verify steps that must reach a position before it is judged (module docstring)
LIKELY_CAUSES = ("aux-layer ids (the engine captures other verifier layers than training did), RoPE parameters "
                 "(rope_theta / rope scaling read differently), norm flags (norm_before_residual, the EAGLE 3.1 "
                 "norms), the vocabulary mapping (d2t)")


@dataclass(frozen=True)
class ServedCounts:
    """What an engine reports for the prompts sent: verify steps that scored drafts, and per draft position j the
    steps that accepted drafts 0..j (vLLM's `num_accepted_tokens_per_pos`; SGLang's histogram, summed from j+1)."""

    engine: str
    drafts: int
    accepted_per_pos: tuple[int, ...]  # length k, non-increasing
    prompts: int = 0

    @property
    def k(self) -> int:
        return len(self.accepted_per_pos)

    def trials(self, j: int) -> int:
        """Steps that reached draft position j (accepted every earlier draft)."""
        return self.drafts if j == 0 else self.accepted_per_pos[j - 1]

    def conditional(self, j: int) -> float | None:
        n = self.trials(j)
        return self.accepted_per_pos[j] / n if n else None

    def tau(self, positions: int | None = None) -> float | None:
        """1 + accepted drafts per verify step, over the first `positions` positions (default all k)."""
        if not self.drafts:
            return None
        return 1 + sum(self.accepted_per_pos[: self.k if positions is None else positions]) / self.drafts


@dataclass(frozen=True)
class PositionGap:
    position: int  # 0-based draft position
    served: float | None  # conditional acceptance served (None: no step reached it)
    trials: int
    upper: float  # the served rate's upper confidence bound (1.0 without trials)
    recorded: float
    floor: float  # recorded - tolerance
    needed: int | None  # verify steps this position needs to be judged (None: its floor <= 0, it cannot fail)

    @property
    def judged(self) -> bool:
        return self.needed is not None and self.trials >= self.needed

    @property
    def below(self) -> bool:
        return self.judged and self.upper < self.floor


@dataclass(frozen=True)
class AcceptanceComparison:
    served: ServedCounts
    positions: tuple[PositionGap, ...]
    tolerance: float
    confidence: float  # one-sided, per position

    @property
    def verdict(self) -> str:
        """"fail" (a judged position below its floor), "pass" (every position that can fail judged, none failed), or
        "undecided" (too few verify steps reached some position: module docstring)."""
        if any(p.below for p in self.positions):
            return "fail"
        testable = [p for p in self.positions if p.needed is not None]
        return "pass" if testable and all(p.judged for p in testable) else "undecided"

    @property
    def ok(self) -> bool:
        return self.verdict == "pass"

    def shortfall(self) -> str:
        """Why there is no verdict, as the end of one line: the first position short of verify steps."""
        short = [p for p in self.positions if p.needed is not None and not p.judged]
        if not short:
            return f"no position can fail (every recorded rate is below the tolerance {self.tolerance:g})"
        p = short[0]
        needed = p.needed or 0
        scale = "" if not p.trials else f", about {math.ceil(self.served.prompts * needed / p.trials)} prompts"
        return (f"position {p.position + 1} was reached by {p.trials} verify step(s) of {self.served.prompts} "
                f"prompt(s), {p.needed} needed (--num-prompts{scale}, or --max-new-tokens)")

    @property
    def served_tau(self) -> float | None:
        return self.served.tau(len(self.positions))

    @property
    def recorded_tau(self) -> float:
        return implied_tau([p.recorded for p in self.positions])

    @property
    def floor_tau(self) -> float:
        return implied_tau([max(p.floor, 0.0) for p in self.positions])

    def line(self, where: str) -> str:
        """One line: the numbers, and on a gap the position that fails and the likely causes."""
        served = " / ".join("-" if p.served is None else f"{p.served:.2f}" for p in self.positions)
        recorded = " / ".join(f"{p.recorded:.2f}" for p in self.positions)
        tau = "-" if self.served_tau is None else f"{self.served_tau:.2f}"
        extra = (f"; positions {len(self.positions) + 1}-{self.served.k} not compared (training recorded "
                 f"{len(self.positions)})" if self.served.k > len(self.positions) else "")
        head = (f"{where} accepts {served} at draft positions 1-{len(self.positions)} (conditional; "
                f"{self.served.drafts} verify steps, {self.served.prompts} prompts; τ {tau}) where validation "
                f"recorded {recorded} (τ {self.recorded_tau:.2f})")
        bad = [p for p in self.positions if p.below]
        if not bad and not self.ok:
            return f"{head}: not enough evidence for a verdict: {self.shortfall()}{extra}"
        if not bad:
            return (f"{head}: within {self.tolerance:g} of it at every position, beyond chance "
                    f"({self.confidence:.1%} bounds; τ floor {self.floor_tau:.2f}){extra}")
        worst = bad[0]
        return (f"{head}: position {worst.position + 1} serves {worst.served:.2f} ({self.confidence:.1%} upper bound "
                f"{worst.upper:.2f}, {worst.trials} tries), below the {worst.floor:.2f} allowed (recorded - "
                f"{self.tolerance:g}){extra}. The engine does not serve what was trained; likely causes: "
                f"{LIKELY_CAUSES}")


def implied_tau(conditional: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} c_j: the acceptance length the conditional rates imply, the verifier's bonus token plus the
    expected accepted drafts (≤ K + 1). Training's simulated τ (train/metrics.py) and the live check both use it."""
    total, running = 1.0, 1.0
    for c in conditional:
        running *= c
        total += running
    return total


def wilson_upper(successes: int, trials: int, confidence: float) -> float:
    """The upper end of the one-sided Wilson score interval of a binomial rate (1.0 without trials)."""
    if trials <= 0:
        return 1.0
    z = NormalDist().inv_cdf(confidence)
    p = successes / trials
    centre = p + z * z / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return min(1.0, (centre + spread) / (1 + z * z / trials))


def steps_to_detect(floor: float, confidence: float) -> int | None:
    """The fewest trials at which 0 successes has a Wilson upper end below `floor` (None when floor <= 0: never)."""
    if floor <= 0:
        return None
    z2 = NormalDist().inv_cdf(confidence) ** 2
    return math.floor(z2 * (1 - floor) / floor) + 1


def compare(served: ServedCounts, recorded: list[float], tolerance: float = TOLERANCE,
            alpha: float = ALPHA, min_steps: int = MIN_VERIFY_STEPS) -> AcceptanceComparison:
    """Served against recorded, position by position over the positions both have (module docstring)."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"--tolerance {tolerance}: expected a number in [0, 1)")
    if min_steps < 1:
        raise ValueError(f"--min-verify-steps {min_steps}: expected at least 1")
    m = min(served.k, len(recorded))
    if m == 0:
        raise ValueError("nothing to compare: the engine reported no draft positions")
    confidence = 1 - alpha / m

    def needed(floor: float) -> int | None:
        detect = steps_to_detect(floor, confidence)
        return None if detect is None else max(min_steps, detect)

    gaps = tuple(PositionGap(j, served.conditional(j), served.trials(j),
                             wilson_upper(served.accepted_per_pos[j], served.trials(j), confidence),
                             float(recorded[j]), float(recorded[j]) - tolerance,
                             needed(float(recorded[j]) - tolerance)) for j in range(m))
    return AcceptanceComparison(served, gaps, tolerance, confidence)


def recorded_accuracies(root: Path, name: str | None = None) -> list[float]:
    """The validation conditional accuracies per TTT step that training wrote into `root`/eagle3_training.json."""
    path = Path(root) / TRAINING_FILE
    where = name or str(root)
    if not path.is_file():
        raise FileNotFoundError(f"{where} has no {TRAINING_FILE}: the live check compares with the validation "
                                "accuracies training records there (`eagle3-hf train` with a validation split)")
    try:
        metrics = json.loads(path.read_text(encoding="utf-8")).get("metrics") or {}
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"{path} is not the JSON object `eagle3-hf train` writes") from None
    values = metrics.get("step_conditional_accuracy") or []
    if not values or any(not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in values):
        raise ValueError(f"{path}: metrics.step_conditional_accuracy is {values!r}, not one rate per TTT step: "
                         "the run recorded no validation metrics (train with --validation-fraction > 0)")
    return [float(v) for v in values]
