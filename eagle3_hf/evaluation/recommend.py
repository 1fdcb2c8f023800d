"""Which serving configuration to recommend, and on what evidence: the one answer the sweep, its JSON, the demo
summary and the model card all print.

On a CPU every configuration decodes at 0.8-1.2x and identical trees measured 0.82x and 1.01x in one sweep, so
"the fastest" of a table is often noise. A speedup is therefore an interval (a paired bootstrap over the
prompts: each prompt decoded plainly and speculatively back to back), and a tree is recommended over the chain
only when the intervals separate. When nothing separates, the recommendation says so and falls back to the
configuration with the most accepted tokens per token the verifier reads (τ / N), which is what pays where
verifying N tokens costs about as much as one (a GPU). With a measured verify-cost table (`bench/speculative.py
--cycle-costs --write-costs FILE`, e.g. from `gpu_check` on an H200) the speedup each configuration would get on
that machine is predicted from τ and the table, and the recommendation follows the prediction.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CONFIDENCE = 0.95
RESAMPLES = 2000


def speedup_interval(plain_seconds: Sequence[float], speculative_seconds: Sequence[float],
                     confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """Bootstrap interval of Σ plain / Σ speculative over paired per-prompt timings (resampling prompts keeps
    each pair together, so a slow moment of the machine hits both sides of the pair)."""
    pairs = [(p, s) for p, s in zip(plain_seconds, speculative_seconds) if p > 0 and s > 0]
    if not pairs:
        raise ValueError("no timed prompt: a speedup interval needs per-prompt plain and speculative seconds")
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(sum(p for p, _ in sample) / sum(s for _, s in sample))
    ratios.sort()
    tail = (1.0 - confidence) / 2
    return ratios[int(tail * (resamples - 1))], ratios[int((1.0 - tail) * (resamples - 1))]


def load_verify_costs(path: str | Path) -> dict[str, Any]:
    """A cost table as `bench/speculative.py --cycle-costs --write-costs` writes it: per-cycle pieces relative to
    a one-token verifier forward (t1) — `verify` by number of tokens, `draft` by number of nodes fed, `update`."""
    try:
        table = json.loads(Path(path).read_text(encoding="utf-8"))
        verify = {int(n): float(c) for n, c in table["verify"].items()}
        draft = {int(k): float(c) for k, c in table["draft"].items()}
        update = float(table["update"])
    except FileNotFoundError:
        raise ValueError(f"{path}: no such verify-cost file") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a verify-cost table (needs verify, draft, update): {e}") from None
    return {"verify": verify, "draft": draft, "update": update, "device": table.get("device", "unknown"),
            "source": str(path)}


def predicted_speedup(tau: float, steps: int, topk: int, num_draft_tokens: int, costs: dict[str, Any]) -> float | None:
    """τ t1 / (verify_N + (S - 1) draft_K + update), every cost relative to t1; None where the table lacks N or K.
    A chain verifies N = S + 1 tokens and feeds one node per drafting step."""
    verify, draft = costs["verify"].get(num_draft_tokens), costs["draft"].get(topk)
    if verify is None or draft is None:
        return None
    return tau / (verify + (steps - 1) * draft + costs["update"])


@dataclass
class Recommendation:
    """What to serve with, and why. `basis`: 'measured' (an interval separated), 'tau_per_verified_token' (no
    measured difference on this machine), or 'predicted' (from a verify-cost table)."""

    steps: int
    topk: int
    num_draft_tokens: int
    basis: str
    reason: str

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def sglang_flags(self, mla: bool = False) -> str:
        return sglang_flags({"steps": self.steps, "topk": self.topk, "num_draft_tokens": self.num_draft_tokens}, mla)

    def as_dict(self, mla: bool = False) -> dict[str, Any]:
        return {**asdict(self), "sglang_flags": self.sglang_flags(mla)}


def sglang_flags(config: dict[str, Any], mla: bool = False) -> str:
    """SGLang's launch flags for (S, K, N), with an attention backend that drafts and verifies trees (K > 1).

    Read from SGLang 0.5.23: trtllm_mha serves K = 1 only, and with a page size above 1 only flashinfer, fa3
    and triton run K > 1; FlashInfer's MLA backend refuses K > 1 outright ("Currently Flashinfer MLA only
    supports topk=1"), so an MLA verifier (DeepSeek-V3, Kimi-K2.5) gets fa3. Rejection sampling
    (`--speculative-use-rejection-sampling`) needs K = 1."""
    flags = (f"--speculative-algorithm EAGLE3 --speculative-num-steps {config['steps']} "
             f"--speculative-eagle-topk {config['topk']} --speculative-num-draft-tokens {config['num_draft_tokens']}")
    if config["topk"] > 1:
        flags += f" --attention-backend {'fa3' if mla else 'flashinfer'}"
    return flags


def _key(row: dict[str, Any]) -> tuple[int, int, int]:
    return row["steps"], row["topk"], row["num_draft_tokens"]


def _by_tau_per_token(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return max(rows, key=lambda r: ((r["acceptance_length"] or 0.0) / r["num_draft_tokens"], -r["num_draft_tokens"]))


def recommend(rows: Sequence[dict[str, Any]], costs: dict[str, Any] | None = None) -> Recommendation:
    """The one recommendation. Each row: steps, topk, num_draft_tokens, acceptance_length, and (when timed)
    speedup with speedup_low / speedup_high; with `costs`, the prediction decides instead of the clock."""
    rows = [r for r in rows if r.get("acceptance_length") is not None]
    if not rows:
        raise ValueError("nothing to recommend: no configuration was decoded")
    if costs is not None:
        predictions = [(predicted_speedup(r["acceptance_length"], r["steps"], r["topk"], r["num_draft_tokens"], costs),
                        r) for r in rows]
        scored = [(p, r) for p, r in predictions if p is not None]
        if scored:
            best_p, best = max(scored, key=lambda pr: pr[0])
            return Recommendation(*_key(best), "predicted",
                                  f"predicted {best_p:.2f}x from τ {best['acceptance_length']:.2f} and the verify "
                                  f"costs of {costs['device']} ({costs['source']})")
    timed = [r for r in rows if r.get("speedup_low") is not None and r.get("speedup_high") is not None]
    chains = [r for r in timed if r["topk"] == 1]
    trees = [r for r in timed if r["topk"] > 1]
    if chains:
        chain = max(chains, key=lambda r: r["speedup"])
        if trees:
            tree = max(trees, key=lambda r: r["speedup"])
            if tree["speedup_low"] > chain["speedup_high"]:
                return Recommendation(*_key(tree), "measured",
                                      f"{tree['speedup']:.2f}x [{tree['speedup_low']:.2f}, {tree['speedup_high']:.2f}] "
                                      f"beats the best chain's {chain['speedup']:.2f}x [{chain['speedup_low']:.2f}, "
                                      f"{chain['speedup_high']:.2f}] measurably on this machine")
        if chain["speedup_low"] > 1.0:
            return Recommendation(*_key(chain), "measured",
                                  f"the chain pays measurably ({chain['speedup']:.2f}x [{chain['speedup_low']:.2f}, "
                                  f"{chain['speedup_high']:.2f}]) and no tree beats it measurably on this machine")
    best = _by_tau_per_token(rows)
    return Recommendation(*_key(best), "tau_per_verified_token",
                          "no configuration beats the chain measurably on this machine; chosen by τ per verified "
                          f"token ({best['acceptance_length']:.2f} / {best['num_draft_tokens']})")
