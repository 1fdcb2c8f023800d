"""fp32 `nn.Linear` on the CPU through oneDNN with prepacked weights, for decoding.

A speculative verify forward reads k + 1 tokens where plain decoding reads one, so its cost relative to a
one-token forward decides the speedup. On the CPU the default fp32 GEMM (MKL; measured on an AMD EPYC)
costs about 1.5x as much for 4 rows as for 1; oneDNN with the weight packed once (what torch.compile's
freezing does) costs about the same for 1 to 5 rows, and less than MKL for one row. Same fp32 arithmetic,
different summation order (~1e-6 relative). `greedy_generate` and `speculative_generate` both run under it,
so the baseline gets the same kernels. The packed copies are cached per module (one extra copy of the weights
while the module lives, so models over MAX_PACKED_BYTES are left alone) and rebuilt when a weight changes.
EAGLE3_HF_ONEDNN=0 switches it off.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

# Rows the packed layout is chosen for: any hint from 4 to 64 measured alike for 1 to 128 rows, while a hint of
# 1 made one row 1.2x and four rows 1.7x slower.
_BATCH_HINT = 64
# A model whose Linear weights exceed this is left on torch's kernels: the packed copy doubles their memory,
# which a small verifier affords and a multi-billion-parameter one on a CPU may not.
MAX_PACKED_BYTES = 4 << 30
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[int, int, torch.Tensor]] = weakref.WeakKeyDictionary()


def available() -> bool:
    """oneDNN ops present and not switched off (EAGLE3_HF_ONEDNN=0 keeps torch's default kernels)."""
    return (os.environ.get("EAGLE3_HF_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def _packed(module: nn.Linear) -> torch.Tensor:
    weight = module.weight
    key = (weight.data_ptr(), weight._version)
    cached = _PACKED.get(module)
    if cached is None or cached[:2] != key:
        with torch.no_grad():
            cached = (*key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT))
        _PACKED[module] = cached
    return cached[2]


def _eligible(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module) is nn.Linear and "forward" not in module.__dict__  # leave hooked/patched modules alone
            and weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
            and (module.bias is None or module.bias.dtype == torch.float32))


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        return nn.Linear.forward(module, x)
    return torch.ops.mkldnn._linear_pointwise(x, _packed(module), module.bias, "none", [], "")


@contextlib.contextmanager
def prepacked_linears(*models: object) -> Iterator[None]:
    """Within the block, every fp32 CPU `nn.Linear` of `models` (non-modules are skipped) runs through oneDNN
    with its packed weight whenever gradients are off; restored on exit."""
    patched: list[nn.Module] = []
    try:
        if available():
            for model in models:
                if not isinstance(model, nn.Module):
                    continue
                modules = [module for module in model.modules() if _eligible(module)]
                weights = [cast(torch.Tensor, m.weight) for m in modules]  # Linears (`_eligible`)
                if sum(w.numel() * w.element_size() for w in weights) > MAX_PACKED_BYTES:
                    continue
                for module in modules:
                    module.forward = _forward.__get__(module)
                    patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
