"""Reading features back: a memory-mapped dataset over the store's shards (`store.py`).

FeatureDataset maps each shard once (numpy memmap) and builds every tensor as a view at the sample's byte
offset, so opening a 900 GB directory reads only the manifest and a sample costs only its own bytes. Shards
are checked on open (size, truncation, and sha256 once per directory by default: verify.py) so a corrupt file
fails loudly with its name.
Packing those samples into the trainer's rows is `packing.py`.
"""

from __future__ import annotations

import copy
import json
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ..data.prepared_samples import select_split
from .quantize import dequantize
from .records import SAMPLE_KEYS, SampleRecord, ShardRecord
from .store import load_manifest
from .verify import verify_shards

_ST_DTYPES = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32, "F16": torch.float16,
              "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}
_MAX_OPEN_SHARDS = 64  # each memmap holds a file descriptor
# one stored tensor of a shard: (key, dtype, row shape, elements per row, bytes per row, byte offset of row 0)
_TensorLayout = tuple[str, torch.dtype, tuple[int, ...], int, int, int]


def read_safetensors_header(path: Path, expected_bytes: int | None = None) -> tuple[int, dict[str, dict[str, Any]]]:
    """(data_start, {name: info}) of a safetensors file, checking it is whole (not truncated)."""
    size = path.stat().st_size
    if expected_bytes is not None and size != expected_bytes:
        raise ValueError(f"shard {path} is {size} bytes, the manifest says {expected_bytes}: truncated or corrupt")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"shard {path} is truncated ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"shard {path} is truncated or corrupt (header of {n} bytes, file of {size})")
        try:
            header: dict[str, dict[str, Any]] = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"shard {path} has a corrupt safetensors header") from None
    header.pop("__metadata__", None)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"shard {path} is truncated: tensors need {8 + n + end} bytes, file has {size}")
    return 8 + n, header


class StoredFeatures:
    """A row's features still as stored: (values [n, R*H], f32 scales [n, R] or None) pieces, views into the
    mapped shards. PackedCollator decodes them straight into the batch: one pass, no float32 temporaries."""

    def __init__(self, pieces: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        self.pieces = pieces

    @property
    def shape(self) -> torch.Size:
        return torch.Size([sum(q.shape[0] for q, _ in self.pieces), self.pieces[0][0].shape[1]])

    def decode_into(self, out: torch.Tensor) -> None:
        """Write the values into `out` [n, R*H], in its dtype (the stored half precision, or float32)."""
        start = 0
        for q, scale in self.pieces:
            dequantize(q, scale, out=out[start : start + q.shape[0]])  # bf16: the cast happens in the copy
            start += q.shape[0]

    def float(self) -> torch.Tensor:
        out = torch.empty(self.shape)
        self.decode_into(out)
        return out


class FeatureDataset(Dataset[dict[str, Any]]):
    """Samples of a feature directory: dicts of tensors in float32 / int64 / bool, read zero-copy from shards.

    verify: "once" (sizes on open; each shard's sha256 unless its writer or verify.py's record vouches for this
    very file: the default), "shard" (sizes + sha256 of every shard on open), "sample" (sizes on open, each
    sample's sha256 when read) or "none" (sizes only; `verify_checksums` later, as training does once its cheap
    checks have passed). verify_threads: hashing threads (None: verify.default_threads). allow_partial: read an
    unfinished extraction's samples (with a warning) instead of refusing it (store.load_manifest); node_part: read
    one node's part of a multi-node extraction (a training run over every node's part).
    """

    def __init__(self, features_dir: str | Path, split: str = "train", validation_fraction: float = 0.05,
                 verify: str = "once", max_tokens: int | None = None, subset_seed: int = 0,
                 allow_partial: bool = False, verify_threads: int | None = None, node_part: bool = False) -> None:
        if verify not in ("once", "shard", "sample", "none"):
            raise ValueError(f"verify must be 'once', 'shard', 'sample' or 'none', got {verify!r}")
        self.features_dir = Path(features_dir)
        self.manifest = load_manifest(self.features_dir, allow_partial, node_part)
        self.verify = verify
        self.hashed_shards = 0  # shards whose sha256 this open computed (verify.py)
        verifier = self.manifest["verifier"]
        self.hidden_size = int(verifier["hidden_size"])
        self.aux_layer_indices = tuple(self.manifest["aux_layer_indices"])
        self._layout: dict[str, list[_TensorLayout]] = {}  # shard -> its stored tensors
        for shard in self.manifest["shards"]:
            path = self.features_dir / shard["file"]
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} listed in the manifest is missing")
            self._layout[shard["file"]] = self._check_layout(path, shard)
        if verify in ("once", "shard"):
            self.verify_checksums("once" if verify == "once" else "always", verify_threads)
        self._samples: list[SampleRecord] = self.manifest["samples"]
        self._keep(split, validation_fraction, max_tokens, subset_seed)

    def select(self, split: str, validation_fraction: float = 0.05, max_tokens: int | None = None,
               subset_seed: int = 0) -> FeatureDataset:
        """`split` of this dataset's samples, sharing its manifest and checked shards: one directory opened once
        gives both training splits (open it with split "all")."""
        part = copy.copy(self)
        part._keep(split, validation_fraction, max_tokens, subset_seed)
        return part

    def _keep(self, split: str, validation_fraction: float, max_tokens: int | None, subset_seed: int) -> None:
        keep = select_split([s["id"] for s in self._samples], split, validation_fraction)
        self.split, self._samples = split, [self._samples[i] for i in keep]
        if max_tokens is not None:  # nested, source-stratified, seeded subsets for data scaling (data/subsets.py)
            from ..data.subsets import token_subset

            chosen = token_subset([s["id"] for s in self._samples], [int(s["length"]) for s in self._samples],
                                  max_tokens, subset_seed)
            self._samples = [self._samples[i] for i in chosen]
        self.lengths: list[int] = [int(s["length"]) for s in self._samples]
        self.sample_ids: list[str] = [s["id"] for s in self._samples]
        self._open: OrderedDict[str, np.memmap] = OrderedDict()  # this split's own maps

    def verify_checksums(self, mode: str = "once", threads: int | None = None) -> int:
        """Every shard of the directory (both splits) against the manifest's sha256 (verify.py: once, always,
        never); returns how many were hashed, also kept in `hashed_shards`."""
        self.hashed_shards = verify_shards(self.features_dir, self.manifest["shards"], mode, threads)
        return self.hashed_shards

    def _check_layout(self, path: Path, shard: ShardRecord) -> list[_TensorLayout]:
        data_start, header = read_safetensors_header(path, shard.get("bytes"))
        for key in ("input_ids", "loss_mask", "verifier_greedy", "aux_hidden_states", "last_hidden_state"):
            if key not in header:
                raise ValueError(f"shard {path} has no tensor {key!r}")
            if header[key]["shape"][0] != shard["num_tokens"]:
                raise ValueError(f"shard {path}: {key} has {header[key]['shape'][0]} rows, manifest says "
                                 f"{shard['num_tokens']} tokens")
        layout: list[_TensorLayout] = []
        for key in SAMPLE_KEYS:
            if key in header:
                info = header[key]
                dtype = _ST_DTYPES[info["dtype"]]
                row = int(np.prod(info["shape"][1:], dtype=np.int64))
                layout.append((key, dtype, tuple(info["shape"][1:]), row, row * dtype.itemsize,
                               data_start + info["data_offsets"][0]))
        return layout

    def __len__(self) -> int:
        return len(self._samples)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers re-open their own maps
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        return state

    def _map(self, name: str) -> np.memmap:
        mm = self._open.get(name)
        if mm is None:
            # copy-on-write mapping: writable for torch.frombuffer, never written back
            mm = np.memmap(self.features_dir / name, dtype=np.uint8, mode="c")
            self._open[name] = mm
            if len(self._open) > _MAX_OPEN_SHARDS:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(name)
        return mm

    def raw(self, index: int, start: int = 0, end: int | None = None) -> dict[str, torch.Tensor]:
        """Stored tensors of tokens [start, end) of one sample, as views into the mapped shard (no copy)."""
        s = self._samples[index]
        length = s["length"]
        end = length if end is None else min(end, length)
        if not 0 <= start <= end:
            raise IndexError(f"sample {s['id']!r}: bad token range [{start}, {end}) of {length}")
        mm, n, first = self._map(s["shard"]), end - start, s["offset"] + start
        out: dict[str, torch.Tensor] = {}
        for key, dtype, shape, row, row_bytes, base in self._layout[s["shard"]]:
            t = torch.frombuffer(mm, dtype=dtype, count=n * row, offset=base + first * row_bytes) if n else \
                torch.empty(0, dtype=dtype)
            out[key] = t.view(n, *shape)
        return out

    def byte_ranges(self, index: int) -> list[tuple[Path, int, int]]:
        """(shard path, byte offset, byte count) of each stored tensor of a sample (for raw readers, benchmarks)."""
        s = self._samples[index]
        return [(self.features_dir / s["shard"], base + s["offset"] * row_bytes, s["length"] * row_bytes)
                for _key, _dtype, _shape, _row, row_bytes, base in self._layout[s["shard"]]]

    def get(self, index: int, start: int = 0, end: int | None = None, decode: bool = True) -> dict[str, Any]:
        """Tokens [start, end) of sample `index`, features dequantised to float32 (or StoredFeatures views)."""
        raw = self.raw(index, start, end)
        sample = self._samples[index]
        if self.verify == "sample" and (start, end) in ((0, None), (0, sample["length"])):
            from .store import sample_sha256

            if sample_sha256(raw) != sample["sha256"]:
                raise ValueError(f"sample {sample['id']!r} in shard {self.features_dir / sample['shard']} is corrupt "
                                 f"(sha256 mismatch)")
        out: dict[str, Any] = {
            "input_ids": raw["input_ids"].long(),  # [T]
            "loss_mask": raw["loss_mask"].bool(),  # [T]
            "verifier_greedy": raw["verifier_greedy"].long(),  # [T]
            "sample_id": sample["id"],
            "shard": str(self.features_dir / sample["shard"]),
        }
        for key in ("aux_hidden_states", "last_hidden_state"):  # [T, 3H], [T, H]
            q, scale = raw[key], raw.get(key + "_scale")
            out[key] = dequantize(q, scale) if decode else StoredFeatures([(q, scale)])
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.get(index)
