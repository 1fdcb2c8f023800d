"""The directory route: a feature directory, written by any offline route, as a `FeatureSource` (the table's
"directory" row, `train --features DIR`). Training reads a directory's shards directly (reader.FeatureDataset);
this serves what it stores again, sample by sample, where a source is asked for (the contract test, a cache)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..interface import PreparedSample, SampleFeatures, SourceIdentity
from ..reader import FeatureDataset
from ..table import SourceRequest


class DirectoryFeatures:
    """A feature directory as a `FeatureSource`: its own identity (the manifest, `SourceIdentity.from_header`) and
    the features it stores, per sample id, for samples holding the same tokens. Training reads a directory through
    FeatureDataset directly; this is the table's row for it (table.py): what it stores, served again."""

    def __init__(self, features_dir: str | Path, allow_partial: bool = False) -> None:
        self.dataset = FeatureDataset(features_dir, "all", allow_partial=allow_partial)
        self.identity = SourceIdentity.from_header(self.dataset.manifest)
        self._position = {sid: i for i, sid in enumerate(self.dataset.sample_ids)}

    def check(self, lengths: Sequence[int]) -> int | None:
        return None

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        where = self.dataset.features_dir
        for sample in samples:
            if sample.sample_id not in self._position:
                raise ValueError(f"{where} holds no features for sample {sample.sample_id!r}")
            f = self.dataset[self._position[sample.sample_id]]
            if not torch.equal(f["input_ids"], sample.input_ids.long()):
                raise ValueError(f"{where}: sample {sample.sample_id!r} holds other tokens than the prepared sample")
            yield SampleFeatures(sample, f["aux_hidden_states"], f["last_hidden_state"], f["verifier_greedy"])

    def report(self) -> dict[str, Any]:
        return {"directory": str(self.dataset.features_dir)}


def open_source(request: SourceRequest) -> DirectoryFeatures:
    """The table's opener (table.py): the directory `request.target`."""
    return DirectoryFeatures(request.target)


def recorded_verifier(target: str) -> tuple[str | None, str | None]:
    """(name, revision) of the verifier a directory's manifest records; (None, None) where it cannot be read
    (opening the directory for training then says why)."""
    from ..store import read_manifest

    try:
        record = read_manifest(target).get("verifier") or {}
    except (OSError, ValueError, KeyError):
        return None, None
    return (str(record["name"]) if record.get("name") else None), record.get("revision")
