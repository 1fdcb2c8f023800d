"""Which verifier is the teacher: cheap hashes that tell two checkpoints of the same shape apart.

Two verifiers with the same hidden size, layer count and tokenizer fit the same features, yet a drafter trained
on one's states against the other's head learns nothing useful. The features record (manifest's `verifier`,
a feature server's /identity) two hashes, and training compares them with its --verifier's:

  config_sha256  sha256 of config.json as canonical JSON (keys sorted), without the fields that describe the
                 file rather than the model (`FILE_FIELDS`: the transformers version that saved it, its path,
                 the dtype it was saved in)
  head_sha256    sha256 of the names, shapes and dtypes of the tensors the teacher reads (the final norm,
                 lm_head, the input embedding) as the safetensors headers list them: no tensor data is read

Both are read from files (a local directory, or the Hub's cache through hf_hub_download): a verifier given as a
loaded model with no files, or one whose files cannot be read here, has none (None), and a check then compares
what the records do hold. Fine-tunes that keep their base's config and tensor layout are not told apart.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

FILE_FIELDS = ("_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype")
_LAYER = re.compile(r"\.\d+\.")  # a tensor inside a numbered block (a layer's norm, an expert)
TEACHER_SUFFIXES = ("lm_head.weight", "embed_tokens.weight", "norm.weight", "ln_f.weight")


def config_sha256(config: dict[str, Any]) -> str:
    """sha256 of a config.json's canonical JSON, the file's own fields left out."""
    kept = {k: v for k, v in config.items() if k not in FILE_FIELDS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def teacher_tensors(names: list[str]) -> list[str]:
    """The tensors whose metadata is hashed: lm_head, the input embedding and the final norm, outside any
    numbered block and any MTP or vision tower."""
    return sorted(n for n in names if n.endswith(TEACHER_SUFFIXES) and not _LAYER.search(f".{n}")
                  and "mtp" not in n and "vision" not in n and "visual" not in n)


def head_sha256(tensors: dict[str, dict[str, Any]]) -> str:
    """sha256 of the teacher tensors' (name, shape, dtype), from safetensors headers ({name: {dtype, shape}})."""
    meta = [[n, [int(d) for d in tensors[n]["shape"]], str(tensors[n]["dtype"])]
            for n in teacher_tensors(list(tensors))]
    return hashlib.sha256(json.dumps(meta, separators=(",", ":")).encode()).hexdigest()


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: {tensor name: {dtype, shape, data_offsets}} (8 bytes + JSON, no data)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        if size > 100 << 20:
            raise ValueError(f"{path}: a safetensors header of {size} bytes")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _fetcher(name_or_path: str, revision: str | None) -> Callable[[str], Path | None]:
    """filename -> a local path: in the directory, or through the Hub's cache; None where there is none."""
    from .loading import resolve_verifier

    local = Path(resolve_verifier(name_or_path))
    if local.is_dir():
        return lambda filename: local / filename if (local / filename).is_file() else None
    if local.exists() or name_or_path.count("/") != 1:
        return lambda filename: None  # a file, or no Hub id: nothing to read

    def fetch(filename: str) -> Path | None:
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(name_or_path, filename, revision=revision))
        except Exception:  # noqa: BLE001 - absent, private, offline: the hash is simply not known here
            return None

    return fetch


def teacher_hashes(name_or_path: str, revision: str | None = None) -> dict[str, str]:
    """{"config_sha256", "head_sha256"} of a verifier's files, each left out when it cannot be read here."""
    fetch = _fetcher(str(name_or_path), revision)
    out: dict[str, str] = {}
    config = fetch("config.json")
    if config is not None:
        out["config_sha256"] = config_sha256(json.loads(config.read_text(encoding="utf-8")))
    try:
        index = fetch("model.safetensors.index.json")
        if index is not None:
            where: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            tensors: dict[str, dict[str, Any]] = {}
            for shard in sorted({where[n] for n in teacher_tensors(list(where))}):
                path = fetch(shard)
                if path is None:
                    return out
                tensors.update(safetensors_header(path))
        else:
            single = fetch("model.safetensors")
            if single is None:
                return out
            tensors = safetensors_header(single)
    except (OSError, ValueError, KeyError):
        return out
    out["head_sha256"] = head_sha256(tensors)
    return out
