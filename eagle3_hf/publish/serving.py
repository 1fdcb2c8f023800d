"""What a drafter's serve commands need beyond the drafter: the verifier's tensor-parallel size and remote code, and
the dtype the drafter's weights are published in.

- Tensor parallel: `--tensor-parallel-size` of `push` when given; else the fewest GPUs, a power of two, whose memory
  (`--gpu-memory-gib`, 80 by default: an H100; 141 for an H200) at 80 % holds the verifier's weights
  (verifier/footprint.py: its config and safetensors index, never a weight file), the rest left to the KV cache.
- Remote code: the verifier's config.json or tokenizer_config.json names code of its own (`auto_map`, Kimi-K2.5's
  tokenizer and config): both engines load it only with `--trust-remote-code`, which the card then prints and says
  why, so that a reader knows what the flag runs.
- Dtype: the engines load the drafter in the verifier's dtype; `push` writes its floating tensors in bf16 unless
  told (`--dtype`), the peers' size (fp32 doubles the download), and keeps `d2t` (int64) and `t2d` (bool) as they are.

Where the verifier cannot be read (offline, gated), the card says the tensor-parallel size was not derived.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PUSH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DEFAULT_PUSH_DTYPE = "bf16"
DEFAULT_GPU_GIB = 80.0
NODE_GPUS = 8


@dataclass(frozen=True)
class ServingFacts:
    """What the serve commands carry for the verifier, and why."""

    tensor_parallel: int | None = None  # None: not derived (the verifier could not be read)
    tp_basis: str = "not derived: the verifier's config could not be read"
    trust_remote_code: bool = False
    remote_code_files: tuple[str, ...] = ()  # the verifier's files that name code (auto_map)


def verifier_serving(verifier: str | None, tensor_parallel: int | None = None,
                     gpu_gib: float = DEFAULT_GPU_GIB, revision: str | None = None) -> ServingFacts:
    """ServingFacts of `verifier` (a Hub id or a local directory): read, never loaded."""
    if not verifier:
        return ServingFacts(tensor_parallel, "given (--tensor-parallel-size)" if tensor_parallel else
                            "not derived: no verifier recorded")
    from ..verifier.checkpoint_files import CheckpointFiles
    from ..verifier.footprint import checkpoint_footprint, engine_gpus

    code: list[str] = []
    try:
        files = CheckpointFiles(verifier, revision)
        for name in ("config.json", "tokenizer_config.json"):
            path = files.fetch(name)
            if path is not None and json.loads(path.read_text(encoding="utf-8")).get("auto_map"):
                code.append(name)
    except Exception as exc:  # noqa: BLE001 - offline, gated: the card says what was not derived
        logger.warning("cannot read the verifier %s (%s): the serve commands carry no tensor-parallel size or "
                       "remote-code flag unless given", verifier, type(exc).__name__)
        return ServingFacts(tensor_parallel, "given (--tensor-parallel-size)" if tensor_parallel else
                            f"not derived: the verifier {verifier}'s config could not be read")
    if tensor_parallel:
        basis = "given (--tensor-parallel-size)"
    else:
        try:
            weights = checkpoint_footprint(verifier, "auto", revision)
        except Exception as exc:  # noqa: BLE001 - a config we cannot size
            return ServingFacts(None, f"not derived: the verifier's size is not readable ({type(exc).__name__})",
                                bool(code), tuple(code))
        tensor_parallel = engine_gpus(weights.bytes, gpu_gib * 2**30)
        basis = (f"the fewest GPUs of {gpu_gib:g} GiB whose memory at 80 % holds the verifier's weights, "
                 f"{weights.describe()}")
        if tensor_parallel > NODE_GPUS:
            basis += (f"; more than one {NODE_GPUS}-GPU node: larger GPUs (`push --gpu-memory-gib`), or the engines' "
                      "multi-node launch")
    return ServingFacts(tensor_parallel, basis, bool(code), tuple(code))


def stage_in_dtype(folder: Path, out: Path, dtype: str, allow: list[str], ignore: list[str]) -> Path:
    """Copy the top-level files `allow` matches (and `ignore` does not) from `folder` into `out`, every floating
    tensor of each safetensors file in `dtype` (bf16 / fp16 / fp32), the others (d2t int64, t2d bool) unchanged,
    and config.json's dtype set to match."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    target = getattr(torch, PUSH_DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(folder.iterdir()):
        name = path.name
        if not path.is_file() or not any(fnmatch.fnmatch(name, p) for p in allow) or any(
                fnmatch.fnmatch(name, p) for p in ignore):
            continue
        if name.endswith(".safetensors"):
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {"format": "pt"}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            if any(t.is_floating_point() and t.dtype != target for t in tensors.values()):
                save_file({k: t.to(target) if t.is_floating_point() else t for k, t in tensors.items()},
                          str(out / name), metadata=metadata)
                continue
        elif name == "config.json":
            config = json.loads(path.read_text(encoding="utf-8"))
            if str(config.get("dtype") or config.get("torch_dtype") or "float32") != PUSH_DTYPES[dtype]:
                config["dtype"] = PUSH_DTYPES[dtype]
                if "torch_dtype" in config:
                    config["torch_dtype"] = PUSH_DTYPES[dtype]
                (out / name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
                continue
        shutil.copy2(path, out / name)  # already in the dtype: the very bytes
    return out


def weights_dtype(folder: Path) -> str | None:
    """The dtype of the floating tensors a checkpoint stores (read from the safetensors headers), e.g. bfloat16."""
    from safetensors import safe_open

    found: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                dtype = str(f.get_slice(key).get_dtype())
                if dtype.startswith(("F", "BF")):
                    found.add({"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(dtype, dtype))
    return ", ".join(sorted(found)) or None
