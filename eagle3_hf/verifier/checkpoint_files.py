"""A verifier checkpoint read file by file, from a local directory or the Hub alike: its config.json, its safetensors
index, and single tensors by name, fetching only the shards that hold them. The verifier's head and embedding are
read this way, so a 1 T-parameter verifier is never built, loaded or downloaded whole to read two tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointFiles:
    """The files of `name_or_path` (a directory or a Hub repo id at `revision`) fetched one at a time and kept."""

    def __init__(self, name_or_path: str, revision: str | None = None):
        from .loading import resolve_verifier

        self.name, self.revision = str(name_or_path), revision
        self.local = Path(resolve_verifier(self.name))
        self._weight_map: dict[str, str] | None = None
        self.index_file: Path | None = None

    def fetch(self, filename: str) -> Path | None:
        """The file's local path (downloaded once from the Hub), or None when the checkpoint has no such file; a
        file that could not be fetched (auth, network) is an OSError naming it, not a missing file."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        from .loading import hub_read_error

        if self.local.is_dir():
            return self.local / filename if (self.local / filename).is_file() else None
        try:
            return Path(hf_hub_download(self.name, filename, revision=self.revision))
        except EntryNotFoundError as exc:
            if isinstance(exc, LocalEntryNotFoundError):  # not cached and the Hub not reachable: not "absent"
                raise hub_read_error(self.name, filename, exc) from None
            return None  # the repository has no such file (a single-file checkpoint has no index)
        except Exception as exc:  # noqa: BLE001 - every other failure is auth or transport: one line
            raise hub_read_error(self.name, filename, exc) from None

    def config(self) -> dict[str, Any]:
        """config.json as a dict (nested text_config kept: family.text_config reads it)."""
        path = self.fetch("config.json")
        if path is None:
            raise FileNotFoundError(f"{self.name}: no config.json")
        return dict(json.loads(path.read_text(encoding="utf-8")))

    def weight_map(self) -> dict[str, str]:
        """{tensor name: file}: the index's, else the single model.safetensors' own names."""
        if self._weight_map is None:
            from safetensors import safe_open

            self.index_file = self.fetch(INDEX_FILE)
            if self.index_file is not None:
                with open(self.index_file, encoding="utf-8") as f:
                    self._weight_map = {str(k): str(v) for k, v in json.load(f)["weight_map"].items()}
            else:
                single = self.fetch(SINGLE_FILE)
                if single is None:
                    raise FileNotFoundError(f"{self.name}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
                self.index_file = single
                with safe_open(str(single), framework="pt") as st:
                    self._weight_map = {k: SINGLE_FILE for k in st.keys()}
        return self._weight_map

    def tensor(self, key: str) -> torch.Tensor:
        """One tensor by name, in its stored dtype, from the one file that holds it."""
        from safetensors import safe_open

        filename = self.weight_map()[key]
        path = self.fetch(filename)
        if path is None:
            raise FileNotFoundError(f"{self.name}: {filename} (holding {key!r}, says {INDEX_FILE}) is missing")
        with safe_open(str(path), framework="pt") as st:
            return st.get_tensor(key)

    def tensors(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """Several tensors by name, in their stored dtypes, each file opened once (a layer's hundreds of experts)."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(self.weight_map()[key], []).append(key)
        out: dict[str, torch.Tensor] = {}
        for filename, names in by_file.items():
            path = self.fetch(filename)
            if path is None:
                raise FileNotFoundError(f"{self.name}: {filename} (holding {names[0]!r}, says {INDEX_FILE}) is missing")
            with safe_open(str(path), framework="pt") as st:
                out.update((name, st.get_tensor(name)) for name in names)
        return out

    def where(self) -> str:
        """The file the weight map came from, for messages."""
        self.weight_map()
        return str(self.index_file)


def verifier_io_weights(name_or_path: str, revision: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, H], lm_head [V, H]) in float32, read by tensor name from the verifier's safetensors
    (checkpoint_files.py), so a 1 T-parameter verifier is never instantiated (nor fully downloaded) to train its
    drafter offline. The head falls back to the embedding only when the config ties them; a file that could not
    be fetched (auth, network) is an error, not a missing file."""
    files = CheckpointFiles(name_or_path, revision)
    where = files.weight_map()

    def find(suffix: str) -> str | None:
        hits = sorted(k for k in where if k.endswith(suffix) and "mtp" not in k and "vision" not in k)
        return hits[0] if hits else None

    embed_key, head_key = find("embed_tokens.weight"), find("lm_head.weight")
    if embed_key is None:
        raise ValueError(f"{name_or_path}: no *embed_tokens.weight tensor found")
    if head_key is None:
        from .loading import load_config

        config = load_config(str(files.local) if files.local.is_dir() else name_or_path, revision=revision)
        if not getattr(config, "tie_word_embeddings", False):
            raise ValueError(f"{name_or_path}: no *lm_head.weight tensor in {files.where()} and its "
                             "config.json has tie_word_embeddings false: the head is not the embedding")
        head_key = embed_key  # tied embeddings
    return files.tensor(embed_key).float(), files.tensor(head_key).float()
