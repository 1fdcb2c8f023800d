"""The verifier's greedy token from its final state, where the verifier runs: the full-vocabulary argmax of
lm_head(h), chunked over tokens and vocabulary so [T, V] logits never exist at once.

Two ways, chosen by the head's weight dtype:

- float32 weights: fp32 logits, chunk by chunk (the exact reference; the CPU default).
- bfloat16 / float16 weights (the accelerator default, `head_dtype`): low-precision logits with fp32
  accumulation pick the TOP_K candidates of each position, and those few are rescored in fp32 against the fp32
  state. So the token equals the fp32 reference's except where the reference's top two logits are a numerical
  tie (the true argmax would have to fall outside the low-precision top TOP_K), at a fraction of the memory
  traffic: a 163,840 x 7168 head is 2.3 GB in bf16 instead of 4.7 GB.

The head lives on `head_device()`: the accelerator when there is one (`cuda:LOCAL_RANK`), else the CPU. On a
CPU, bf16 pays only with native bf16 matrix units (AMX or AVX-512 BF16: 4.4x faster than fp32 at Kimi-K2.5's
shape on a 2-core AMX machine, `bench/greedy_head.py`); without them (AVX2 only) oneDNN's bf16 GEMM is slower
than fp32 (8.4 against 76 GFLOP/s measured for the README's demo machine), so fp32 stays there.
`EAGLE3_HF_HEAD_DTYPE` overrides the choice.
"""

from __future__ import annotations

import os
from typing import cast

import torch
from torch import nn

from .family import softcap_logits

# elements of one [tokens, vocab] logits chunk: 64 M (256 MB in fp32) whatever the vocabulary is
LOGIT_ELEMENTS_PER_CHUNK = 1 << 26
MAX_TOKENS_PER_CHUNK = 1024
MIN_VOCAB_PER_CHUNK = 4096
TOP_K = 8  # low-precision candidates rescored in fp32 per position
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def head_device() -> torch.device:
    """Where the final norm and the greedy head run: this process's accelerator (LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0) % torch.cuda.device_count())
    return torch.device("cpu")


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_has_bf16() -> bool:
    """Native bf16 matrix units (AMX or AVX-512 BF16): there bf16 GEMMs beat fp32 ones."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def head_dtype(device: torch.device) -> torch.dtype:
    """bf16 on an accelerator and on a CPU with bf16 units, else fp32 (module docstring); EAGLE3_HF_HEAD_DTYPE
    (float32, bfloat16, float16) overrides."""
    chosen = os.environ.get("EAGLE3_HF_HEAD_DTYPE")
    if chosen:
        if chosen not in DTYPES:
            raise ValueError(f"EAGLE3_HF_HEAD_DTYPE={chosen!r}: choose one of {', '.join(DTYPES)}")
        return DTYPES[chosen]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return torch.bfloat16


def _chunks(tokens: int, vocab: int) -> tuple[int, int]:
    rows = max(1, min(tokens, MAX_TOKENS_PER_CHUNK))
    cols = min(vocab, max(MIN_VOCAB_PER_CHUNK, LOGIT_ELEMENTS_PER_CHUNK // rows))
    return rows, cols


def _argmax_fp32(h: torch.Tensor, weight: torch.Tensor, softcap: float | None, cols: int) -> torch.Tensor:
    """Exact fp32 argmax over vocabulary chunks; the first index wins a tie, as torch.argmax does."""
    best_val = torch.full((h.shape[0],), float("-inf"), device=h.device)
    best_idx = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
    for v0 in range(0, weight.shape[0], cols):
        logits = softcap_logits(h @ weight[v0:v0 + cols].float().T, softcap)  # [c, cols]
        val, idx = logits.max(dim=-1)
        better = val > best_val
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, idx + v0, best_idx)
    return best_idx


def _argmax_rescored(h: torch.Tensor, weight: torch.Tensor, softcap: float | None, cols: int) -> torch.Tensor:
    """Low-precision logits (fp32 accumulation) -> TOP_K candidates -> fp32 logits of those -> argmax."""
    hq = h.to(weight.dtype)
    cand_val: torch.Tensor | None = None
    cand_idx: torch.Tensor | None = None
    for v0 in range(0, weight.shape[0], cols):
        logits = hq @ weight[v0:v0 + cols].T  # [c, cols], low precision
        k = min(TOP_K, logits.shape[1])
        val, idx = logits.topk(k, dim=-1)
        idx = idx + v0
        if cand_val is not None and cand_idx is not None:
            val, pick = torch.cat([cand_val, val], -1).topk(min(TOP_K, cand_val.shape[1] + k), dim=-1)
            idx = torch.cat([cand_idx, idx], -1).gather(-1, pick)
        cand_val, cand_idx = val, idx
    assert cand_idx is not None
    cand_idx, _ = cand_idx.sort(dim=-1)  # ascending ids: an exact tie goes to the lowest id, as torch.argmax
    exact = torch.einsum("ch,ckh->ck", h, weight[cand_idx].float())  # [c, k] fp32
    return cand_idx.gather(-1, softcap_logits(exact, softcap).argmax(-1, keepdim=True)).squeeze(-1)


@torch.no_grad()
def greedy_argmax(weight: torch.Tensor, hidden: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """argmax_v softcap(hidden @ weight.T) per row: weight [V, H] (on the device that computes), hidden [T, H]
    (any device, any float dtype; taken as fp32) -> int64 [T] on hidden's device."""
    out_device = hidden.device
    h = hidden.to(weight.device, torch.float32)
    rows, cols = _chunks(h.shape[0], weight.shape[0])
    argmax = _argmax_fp32 if weight.dtype == torch.float32 else _argmax_rescored
    out = [argmax(h[t0:t0 + rows], weight, softcap, cols) for t0 in range(0, h.shape[0], rows)]
    if not out:
        return torch.zeros(0, dtype=torch.long, device=out_device)
    return torch.cat(out).to(out_device)


def head_weight(head: nn.Module) -> torch.Tensor:
    """An output embedding's [V, H] weight."""
    return cast(torch.Tensor, head.weight)
