"""Decoding with a drafter and a verifier, as the engines serve EAGLE-3 and DFlash: plain decoding (plain.py), the
chain (chain.py) and SGLang's tree (tree.py) over one core (core.py), a DFlash drafter's blocks (block.py), each
returning a typed record (result.py); acceptance statistics and the lossless check in stats.py.

`speculative_decode` is the one entry a caller needs: SGLang's (S steps, top-K, N draft tokens), K = 1 the chain;
for a DFlash drafter, S drafts per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from .plain import greedy_generate
from .result import DecodeResult, SpeculativeResult
from .stats import acceptance_stats, compare_to_greedy

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..model.modeling_dflash import DFlashDraftModel
    from ..model.modeling_eagle3 import Eagle3DraftModel

__all__ = ["DecodeResult", "SpeculativeResult", "acceptance_stats", "compare_to_greedy", "greedy_generate",
           "speculative_decode"]


def speculative_decode(verifier: PreTrainedModel, drafter: Eagle3DraftModel | DFlashDraftModel,
                       input_ids: Sequence[int] | torch.Tensor, *, steps: int = 3, topk: int = 1,
                       num_draft_tokens: int | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
                       generator: torch.Generator | None = None, eos_token_id: int | Sequence[int] | None = None,
                       tree_attention: str = "sglang") -> SpeculativeResult:
    """SGLang's (S, K, N): with K = 1 the chain of S drafts per verify forward, with K > 1 a tree of N tokens, the
    root included (default: every candidate of S steps, 1 + K + (S - 1) K^2), drafted under `tree_attention`
    ("sglang" as SGLang drafts, or "ancestors"; a chain is the same under both). A DFlash drafter drafts S tokens
    per block (at most its block_size - 1), no tree."""
    from ..engines.table import kind

    decode = kind(getattr(drafter, "drafter_kind", "eagle3")).decoder_function()  # the drafter's row decides
    return cast("SpeculativeResult", decode(
        verifier, drafter, input_ids, steps=steps, topk=topk, num_draft_tokens=num_draft_tokens,
        max_new_tokens=max_new_tokens, temperature=temperature, generator=generator, eos_token_id=eos_token_id,
        tree_attention=tree_attention))
