"""Rounding features to their storage dtype and back: bf16 and float32 as is, fp8 (float8_e4m3fn) with one float32
scale per hidden-size row. The writer, the reader and the online collators all go through these, so a batch
computed online equals one read back from shards, bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from .records import DTYPES, canonical_dtype

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize(x: torch.Tensor, rows: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, rows*H] float -> stored tensor, plus f32 scales [N, rows] for fp8 (amax of each H-row / 448)."""
    dtype = canonical_dtype(dtype)
    if dtype != "float8_e4m3fn":
        return x.to(DTYPES[dtype]).contiguous(), None
    n = x.shape[0]
    xr = x.float().reshape(n, rows, -1)  # [N, rows, H]
    scale = xr.abs().amax(dim=-1) / FP8_MAX  # [N, rows]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xr / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, -1).contiguous(), scale.contiguous()


_FP8_TABLE = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()  # code -> value


def as_stored(x: torch.Tensor, rows: int, dtype: str | None) -> torch.Tensor:
    """`x` [N, rows*H] rounded exactly as a shard of `dtype` stores it, in the dtype a batch carries it
    (packing.PackedCollator): bf16 stays bf16, fp8 is decoded to float32 with its scales; None: float32, unrounded.
    What the online collators apply, so their batches equal the ones read back from shards, bit for bit."""
    if dtype is None:
        return x.float()
    return carried(*quantize(x, rows, dtype))


def carried(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A stored tensor in the dtype a batch carries it: half precision as stored, fp8 decoded with its scales."""
    return q if scale is None and q.dtype in (torch.bfloat16, torch.float16) else dequantize(q, scale)


def fp8_to_float32(q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float8_e4m3fn -> float32 through a 256-entry table (about 4x torch's CPU cast); `out` must be contiguous."""
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32)
    np.take(_FP8_TABLE, q.contiguous().view(torch.uint8).numpy(), out=out.numpy())
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored tensor [N, rows*H] (+ scales [N, rows]) -> float32 [N, rows*H] (written into `out` if given)."""
    if scale is None:
        return q.float() if out is None else out.copy_(q)
    out = fp8_to_float32(q, out)
    n, rows = scale.shape
    out.view(n, rows, -1).mul_(scale.float()[..., None])
    return out
