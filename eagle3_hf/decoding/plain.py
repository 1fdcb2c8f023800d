"""Plain autoregressive decoding with a KV cache: the baseline of the lossless check and of the speedup, run on
the same kernels as the speculative decoders (core.prepacked)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .core import eos_ids, new_cache, pick, prepacked, top2_margins, verifier_forward
from .result import DecodeResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@prepacked
@torch.inference_mode()
def greedy_generate(verifier: PreTrainedModel, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                    eos_token_id: int | Sequence[int] | None = None, temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> DecodeResult:
    """One verifier forward per token (greedy at temperature 0, sampled above); margins are the top-2 logit gaps."""
    start = time.perf_counter()
    eos = eos_ids(verifier, eos_token_id)
    cache = new_cache(verifier)
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=verifier.device).view(1, -1)  # [1, P]
    tokens: list[int] = []
    margins: list[float] = []
    forwards = 0
    while len(tokens) < max_new_tokens:
        last, _ = verifier_forward(verifier, ids, cache, None, last_only=True)  # [1, V]
        forwards += 1
        margins += top2_margins(last)
        token = pick(last[0], temperature, generator)
        tokens.append(token)
        if token in eos:
            break
        ids = torch.tensor([[token]], device=verifier.device)
    return DecodeResult(tokens=tokens, margins=margins, num_verifier_forwards=forwards,
                        seconds=time.perf_counter() - start)
