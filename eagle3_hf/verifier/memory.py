"""Does the memory a command is given hold the verifier's weights: checked before anything loads.

`extract` on the transformers route loads the whole verifier into this process: on one device (`--device`, or
cuda:LOCAL_RANK, or the CPU), or with `--device-map` over the devices of `--max-memory` (accelerate's default
budget without it: every visible GPU and the CPU's RAM). Without a budget that holds it, accelerate would spill
the rest to a temporary offload folder and read it back from disk at every forward: 2 TB of bf16 Kimi-K2.5 against
8 x 141 GB would take hours per sample. So the weights (verifier/footprint.py: config and safetensors index, never
a weight file) are compared with the memory first and a verifier that does not fit is refused in one line; an
explicit `--offload-folder` is the user's choice to spill, and is only warned about.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..errors import UsageError
from .footprint import Footprint, checkpoint_footprint

GIB = 2**30
# the package transformers needs to load each quantization method's checkpoint as stored
QUANTIZATION_PACKAGES = {"compressed-tensors": "compressed-tensors", "bitsandbytes": "bitsandbytes",
                         "gptq": "gptqmodel", "awq": "autoawq"}


def ram_bytes() -> int:
    """This machine's physical memory."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def gpu_bytes(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).total_memory)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_bytes(device: Any) -> int | None:
    """The memory of one device named as torch or accelerate name it (0, "cuda:1", "cpu"); None for a device whose
    memory is not known here (mps, disk)."""
    name = str(device)
    if name == "cpu":
        return ram_bytes()
    if name.isdigit() or name == "cuda" or name.startswith("cuda:"):
        index = int(name.rsplit(":", 1)[-1]) if ":" in name else (int(name) if name.isdigit() else 0)
        return gpu_bytes(index) if index < gpu_count() else None
    return None


def _size(value: Any) -> int:
    from accelerate.utils import convert_file_size_to_int

    return int(value) if isinstance(value, int) else int(convert_file_size_to_int(str(value)))


def memory_given(device_map: Any, max_memory: dict[Any, Any] | None, device: str | None) -> tuple[int, str] | None:
    """(bytes, what they are) of the memory the verifier may occupy, or None where it is not known."""
    if max_memory:
        budget = {k: v for k, v in max_memory.items() if str(k) != "disk"}
        return (sum(_size(v) for v in budget.values()),
                f"--max-memory {','.join(f'{k}={v}' for k, v in budget.items())}")
    if isinstance(device_map, dict):
        devices = sorted({str(d) for d in device_map.values() if str(d) != "disk"})
        sizes = [device_bytes(d) for d in devices]
        if any(s is None for s in sizes):
            return None
        return sum(s for s in sizes if s), f"the devices of --device-map ({', '.join(devices)})"
    if device_map:
        gpus = gpu_count()
        total = sum(gpu_bytes(i) for i in range(gpus)) + ram_bytes()
        held = f"{gpus} GPU(s) and " if gpus else ""
        return total, f"--device-map {device_map} without --max-memory: {held}this machine's RAM"
    if device is None:
        return None
    size = device_bytes(device)
    return None if size is None else (size, f"--device {device}" if device != "cpu" else "this machine's RAM")


def weights_problem(weights: Footprint, memory: int, where: str) -> str | None:
    """One line when `weights` exceed `memory`, else None."""
    if weights.bytes <= memory:
        return None
    quantized = (f"; it is quantized ({weights.quantized}): transformers keeps it so only with that method's package"
                 if weights.quantized else "")
    return (f"its weights take {weights.describe()}, more than the {memory / GIB:,.1f} GiB of {where}{quantized}")


def quantization_problem(weights: Footprint) -> str | None:
    """One line when the checkpoint is quantized by a method whose package is not installed here."""
    import importlib.util

    package = QUANTIZATION_PACKAGES.get(weights.quantized or "")
    module = {"autoawq": "awq"}.get(package or "", (package or "").replace("-", "_"))
    if not package or importlib.util.find_spec(module):
        return None
    return (f"its weights are stored quantized ({weights.describe()}), which transformers loads only with the "
            f"`{package}` package, not installed here")


def require_memory(verifier: str, revision: str | None, dtype: str, device_map: Any,
                   max_memory: dict[Any, Any] | None, device: str | None, offload_folder: str | None,
                   hint: str) -> Footprint | None:
    """Refuse (UsageError, one line) a verifier whose weights in `dtype` exceed the memory it is given (with an
    explicit `offload_folder`: a warning), or that is stored quantized by a method whose package is missing, before
    any weight is read. A verifier that cannot be sized (no config, no network) passes: loading it says why."""
    try:
        weights = checkpoint_footprint(verifier, dtype, revision)
    except Exception:  # noqa: BLE001 - unsized: the load that follows reports what is wrong with it
        return None
    given = memory_given(device_map, max_memory, device)
    problem = weights_problem(weights, *given) if given else None
    if problem and device_map and offload_folder:
        print(f"WARNING: --verifier {verifier}: {problem}; the rest goes to --offload-folder {offload_folder} and is "
              "read from disk at every forward", file=sys.stderr)
        problem = None
    problem = problem or quantization_problem(weights)
    if problem:
        raise UsageError(f"--verifier {verifier}: {problem}: {hint}")
    return weights
