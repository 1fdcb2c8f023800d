"""Counting the operations that make the host wait for the device, on any device — a CPU included.

On a GPU each such operation drains the launch queue: the host stops queueing kernels until the device has
caught up, and the step runs at the speed of Python. A CPU never waits, so the count is taken from the ops
themselves: `HostSyncCounter` is a TorchDispatchMode that records every op whose result the host must read
(a scalar, a data-dependent shape) plus the Python-level copies to the host (`tolist`, `cpu`, `numpy`).
The test of the training step (tests/train/test_host_syncs.py) and gpu_check use the same counter.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ops whose output the host reads (a Python scalar) or whose output shape depends on the data
_ALWAYS = {
    "_local_scalar_dense",  # .item(), float(t), int(t), bool(t)
    "is_nonzero", "equal",  # bool results
    "nonzero", "argwhere",
    "masked_select",
    "unique_consecutive", "unique_dim", "unique_dim_consecutive", "_unique", "_unique2",
    "bincount",  # output size = max + 1
}
_BOOL = (torch.bool, torch.uint8)


def _is_sync(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = func._overloadpacket.__name__
    if name in _ALWAYS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in _BOOL for i in indices)
    if name == "repeat_interleave":  # output size unknown unless given
        return isinstance(args[0], torch.Tensor) and kwargs.get("output_size") is None and (
            len(args) < 2 or isinstance(args[1], torch.Tensor))
    return False


# TorchDispatchMode's methods are unannotated in torch (its __init_subclass__ runs here)
class HostSyncCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """`with HostSyncCounter() as syncs: ...` then `syncs.total` and `syncs.ops` (name -> count).

    Counts (a) dispatched ops that need a device -> host read (`_is_sync`: scalars, nonzero, unique, bool-mask
    indexing, repeat_interleave without output_size, ...) and (b) Tensor.tolist / .cpu() / .numpy() calls
    on any tensor (on a CPU they dispatch nothing, on a GPU each is a copy the host waits for)."""

    _PATCHED = ("tolist", "cpu", "numpy")

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.ops: Counter[str] = Counter()
        self._saved: dict[str, Any] = {}

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if _is_sync(func, args, kwargs):
            self.ops[str(func._overloadpacket.__name__)] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        for name in self._PATCHED:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))
        entered: HostSyncCounter = super().__enter__()  # type: ignore[no-untyped-call]  # unannotated in torch
        return entered

    def __exit__(self, *exc: Any) -> bool | None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()
        suppress: bool | None = super().__exit__(*exc)  # type: ignore[no-untyped-call]  # unannotated in torch
        return suppress

    def _counting(self, name: str, original: Any) -> Any:
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.ops[f"Tensor.{name}"] += 1
            return original(tensor, *args, **kwargs)

        return wrapper
