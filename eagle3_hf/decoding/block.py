"""Block speculative decoding with a DFlash drafter and a transformers verifier: the real acceptance length.

As vLLM's DFlash proposer runs it (docs/contracts.md, "A second drafter kind: DFlash"): the drafter's context is the
verifier's features of every accepted token (keys and values projected once, `DFlashContext`); each cycle drafts one
block `[last, mask x k]` at the positions after the context (`last` is the verifier's newest token, which has no
features yet) and reads its k mask positions as the drafts d_1 .. d_k; one verifier forward over
[last, d_1 .. d_m] checks them (m = k, fewer near max_new_tokens), the verifier's cache is cropped to the accepted
path and the features of [last, accepted drafts] join the drafter's context. τ and the per-step records are the
chain's (core.Decoding.commit's rules: accepted drafts + the verifier's own token per verify forward, cut at eos);
greedy is token-identical to plain decoding, sampling uses the chain's speculative sampling with q the block's
softmax over the full vocabulary (the drafter shares the verifier's lm_head).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .chain import accept_chain
from .core import (
    crop,
    eos_ids,
    make_rollbackable,
    new_cache,
    pick,
    prepacked,
    probabilities,
    sample,
    top2_margins,
    verifier_forward,
)
from .result import SpeculativeResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..model.modeling_dflash import DFlashDraftModel


@prepacked
@torch.inference_mode()
def block_speculative_generate(verifier: PreTrainedModel, drafter: DFlashDraftModel,
                               input_ids: Sequence[int] | torch.Tensor, k: int | None = None,
                               max_new_tokens: int = 64, temperature: float = 0.0,
                               generator: torch.Generator | None = None,
                               eos_token_id: int | Sequence[int] | None = None) -> SpeculativeResult:
    """k drafts per verify forward (default and most: block_size - 1, as llama.cpp clamps it; vLLM's
    num_speculative_tokens), greedy at temperature 0, speculative sampling above."""
    start = time.perf_counter()
    most = drafter.config.max_drafts
    k = most if k is None else int(k)
    if not 1 <= k <= most:
        raise ValueError(f"k = {k} drafts: a block of {drafter.config.block_size} drafts 1..{most} (block_size - 1)")
    if not drafter.config.aux_hidden_state_indices:
        raise ValueError("the drafter's config names no aux_hidden_state_indices: it cannot read the verifier")
    aux_indices = list(drafter.config.aux_hidden_state_indices)
    device = verifier.device
    greedy = temperature <= 0
    eos = eos_ids(verifier, eos_token_id)

    prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).view(1, -1)  # [1, P]
    n = prompt.shape[1]  # position of the newest token, which no model has read yet
    cache = new_cache(verifier)
    logits, aux = verifier_forward(verifier, prompt, cache, aux_indices, last_only=True)  # [1, V], [1, P, 3H]
    make_rollbackable(cache)
    tokens, margins = [pick(logits[-1], temperature, generator)], top2_margins(logits[-1:])
    context = drafter.extend_context(None, aux, torch.arange(n, device=device)[None])
    accepted_per_step: list[int] = []
    drafted: list[int] = []
    proposals: list[list[int]] = []
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        depth = min(k, max_new_tokens - len(tokens) - 1)  # no draft is wasted on tokens that would be cut
        block = drafter.draft_block(tokens[-1], context, k)[:depth].float()  # [m, V]: the drafts' logits
        if greedy:
            drafts = block.argmax(-1).tolist() if depth else []
        else:
            qs = probabilities(block, temperature)  # [m, V] on the CPU, fp64
            drafts = [sample(q, generator) for q in qs]
        ids = torch.tensor([[tokens[-1]] + drafts], device=device)
        v_logits, v_aux = verifier_forward(verifier, ids, cache, aux_indices)  # [m+1, V], [1, m+1, 3H]
        accepted, bonus = accept_chain(v_logits, drafts, None if greedy else qs, temperature, generator)
        new = drafts[:accepted] + [bonus]
        new_margins = top2_margins(v_logits[: accepted + 1])
        stop = next((j for j, t in enumerate(new) if t in eos), None)
        if stop is not None:  # eos: nothing after it is emitted
            new, new_margins = new[: stop + 1], new_margins[: stop + 1]
            accepted = min(accepted, stop + 1)
        accepted_per_step.append(accepted)
        drafted.append(depth)
        proposals.append(drafts)
        tokens += new
        margins += new_margins
        if len(tokens) >= max_new_tokens or tokens[-1] in eos:
            break
        crop(cache, n + 1 + accepted)
        # the verifier's features of [last, accepted drafts] join the context, at positions n .. n + accepted
        context = drafter.extend_context(context, v_aux[:, : accepted + 1],
                                         torch.arange(n, n + accepted + 1, device=device)[None])
        n += accepted + 1
    return SpeculativeResult(tokens=tokens, margins=margins, num_verifier_forwards=len(accepted_per_step),
                             accepted_per_step=accepted_per_step, drafted_per_step=drafted, draft_tokens=proposals,
                             seconds=time.perf_counter() - start)
