"""Each drafter kind's decoding, one function per row of engines/table.py (its `decoder`), all with
`speculative_decode`'s signature: it picks the function by the drafter's kind and passes every option on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .block import block_speculative_generate
from .chain import speculative_generate
from .result import SpeculativeResult
from .tree import num_candidates, tree_speculative_generate

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..model.modeling_dflash import DFlashDraftModel
    from ..model.modeling_eagle3 import Eagle3DraftModel


def decode_chain_or_tree(verifier: PreTrainedModel, drafter: Eagle3DraftModel, input_ids: Sequence[int] | torch.Tensor,
                         *, steps: int, topk: int, num_draft_tokens: int | None, max_new_tokens: int,
                         temperature: float, generator: torch.Generator | None,
                         eos_token_id: int | Sequence[int] | None, tree_attention: str) -> SpeculativeResult:
    """EAGLE-3: the chain of `steps` drafts with topk 1, SGLang's tree of `num_draft_tokens` above."""
    if topk <= 1:
        return speculative_generate(verifier, drafter, input_ids, k=steps, max_new_tokens=max_new_tokens,
                                    temperature=temperature, generator=generator, eos_token_id=eos_token_id)
    size = num_draft_tokens if num_draft_tokens is not None else 1 + num_candidates(steps, topk)
    return tree_speculative_generate(verifier, drafter, input_ids, steps=steps, topk=topk, num_draft_tokens=size,
                                     max_new_tokens=max_new_tokens, temperature=temperature, generator=generator,
                                     eos_token_id=eos_token_id, tree_attention=tree_attention)


def decode_blocks(verifier: PreTrainedModel, drafter: DFlashDraftModel, input_ids: Sequence[int] | torch.Tensor,
                  *, steps: int, topk: int, num_draft_tokens: int | None, max_new_tokens: int, temperature: float,
                  generator: torch.Generator | None, eos_token_id: int | Sequence[int] | None,
                  tree_attention: str) -> SpeculativeResult:
    """DFlash: `steps` drafts per block (at most its block_size - 1), no tree."""
    if topk > 1:
        raise ValueError(f"--topk {topk}: a DFlash drafter drafts one block, not a tree (use --topk 1)")
    return block_speculative_generate(verifier, drafter, input_ids, k=steps, max_new_tokens=max_new_tokens,
                                      temperature=temperature, generator=generator, eos_token_id=eos_token_id)
