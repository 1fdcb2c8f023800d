"""Chain speculative decoding with an EAGLE-3 drafter and a transformers verifier: the real acceptance length.

A drafter is measured the way an engine uses it (docs/contracts.md, "Metrics"): chain drafting of k
tokens verified by one verifier forward over [last, d_1 .. d_k], both models with KV caches cropped on
rejection, the drafter's cache then extended with the verifier's aux states of the accepted tokens (as
SGLang does; core.py holds the prefill and that commit). Reports τ (accepted drafts + the verifier's own token
per verify forward, ≤ k + 1) and per-position acceptance; the lossless check against plain decoding
(plain.py) is stats.py's. Temperature > 0 uses speculative sampling, exact in distribution; q is the drafter's
draft-vocabulary distribution placed on the verifier vocabulary through d2t (zero elsewhere).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .core import prefill, prepacked, probabilities, sample, verifier_forward
from .result import SpeculativeResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..model.modeling_eagle3 import Eagle3DraftModel


def draft_distribution(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                       temperature: float) -> torch.Tensor:
    """Drafter logits [Vd] -> q over the verifier vocabulary [V] (zero outside the draft vocabulary).
    targets [Vd]: the verifier id of each draft id (d2t mapping, injective)."""
    q = torch.zeros(vocab_size, dtype=torch.float64)
    q[targets] = probabilities(logits, temperature)
    return q


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int],
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling over one chain. p [m+1, V] verifier probs, q [m, V] draft probs, m drafts.

    Returns (accepted, next_token): drafts[:accepted] are kept, then next_token is either the resample
    from norm(max(0, p - q)) at the first rejection or the bonus token from p[m]. Exact in distribution.
    """
    for i, x in enumerate(drafts):
        ratio = float(p[i, x] / q[i, x]) if q[i, x] > 0 else float("inf")
        if float(torch.rand((), dtype=torch.float64, generator=generator)) < min(1.0, ratio):
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        return i, sample(residual / total if total > 0 else p[i], generator)
    return len(drafts), sample(p[len(drafts)], generator)


def accept_chain(v_logits: torch.Tensor, drafts: Sequence[int], qs: torch.Tensor | None, temperature: float,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """(accepted, next_token) for drafts verified in one forward, v_logits [m+1, V] at [last, d_1 .. d_m]: greedy
    at temperature 0 (drafts kept while they equal the verifier's argmax, then its token), speculative sampling
    against the drafts' probabilities qs [m, V] above. Shared by the chain and the block decoders."""
    if temperature <= 0:
        choice = v_logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
            accepted += 1
        return accepted, choice[accepted]
    p = probabilities(v_logits, temperature)
    return verify_sampled(p, qs if qs is not None else p[:0], drafts, generator)


@prepacked
@torch.inference_mode()
def speculative_generate(verifier: PreTrainedModel, drafter: Eagle3DraftModel, input_ids: Sequence[int] | torch.Tensor,
                         k: int = 3, max_new_tokens: int = 64, temperature: float = 0.0,
                         generator: torch.Generator | None = None,
                         eos_token_id: int | Sequence[int] | None = None) -> SpeculativeResult:
    """Chain speculative decoding (greedy at temperature 0, speculative sampling above).

    The prefill produces the first token as in plain decoding; every later verifier forward checks up to k
    drafts (fewer near max_new_tokens, so no draft is wasted on tokens that would be cut).
    """
    start = time.perf_counter()
    device = verifier.device
    greedy = temperature <= 0
    if not greedy:  # verifier id of every draft id, for q on the full vocabulary
        targets = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size, device=drafter.d2t.device))
        targets, vocab_size = targets.cpu(), int(drafter.config.vocab_size)
    state = prefill(verifier, drafter, input_ids, max_new_tokens, temperature, generator, eos_token_id)
    while state.running():
        chain = state.budget(k)
        drafts: list[int] = []  # verifier ids
        qs: list[torch.Tensor] = []  # q over the verifier vocabulary (sampling)
        logits_i, hidden_i, cache_i = state.draft_logits, state.draft_hidden, state.draft_cache
        for i in range(chain):  # the i-th draft (0-based) sits at token index n + 1 + i
            if greedy:
                drafts.append(int(drafter.draft_to_target(logits_i.argmax())))
            else:
                q = draft_distribution(logits_i, targets, vocab_size, temperature)
                qs.append(q)
                drafts.append(sample(q, generator))
            if i + 1 < chain:  # feed the draft back with the drafter's own hidden state, RoPE position n + i
                step = drafter.draft_step(torch.tensor([[drafts[-1]]], device=device), hidden_i,
                                          torch.tensor([[state.n + i]], device=device), cache_i)
                logits_i, hidden_i, cache_i = step[0][0, -1], step[1], step[2]

        # verify: one forward over [last, d_1 .. d_m] at positions n .. n + m
        ids = torch.tensor([[state.last] + drafts], device=device)
        v_logits, v_aux = verifier_forward(verifier, ids, state.cache, state.aux_indices)  # [m+1, V], [1, m+1, 3H]
        accepted, bonus = accept_chain(v_logits, drafts, torch.stack(qs) if qs else None, temperature, generator)
        state.commit(drafts[:accepted], bonus, list(range(accepted + 1)), v_logits, v_aux, depth=chain,
                     proposals=drafts)
    return state.result(start)
