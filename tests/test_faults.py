"""Faults the project promises to survive, each then re-run with the same command: a full disk mid-shard
during `extract`, an OpenAI-compatible endpoint dropping connections during `regenerate`, a SIGKILL during
`push`, and a SIGKILL during two-process ZeRO-3 training resumed from its checkpoint."""

from __future__ import annotations

import errno
import io

import pytest
import torch

from eagle3_hf.data import shards
from eagle3_hf.data.dataset import FeatureDataset
from test_extract import _extract_in_process, make_prepared
from test_extract import fingerprint  # noqa: F401  (fixture)


class _FullDisk(io.FileIO):
    """A file whose disk fills up halfway through the write of one shard."""

    def write(self, data):
        super().write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_enospc_mid_shard_keeps_complete_shards_and_rerun_resumes(tmp_path, tiny_verifier_dir, fingerprint,
                                                                    monkeypatch):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=10)
    full, failed = tmp_path / "full", tmp_path / "failed"
    _extract_in_process(tiny_verifier_dir, prepared, full, fingerprint)
    real_open = open

    def open_filling_disk(path, mode="r", *args, **kwargs):
        if "shard-r000-00002" in str(path) and "w" in mode:  # the third shard
            return _FullDisk(path, "w")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(shards, "open", open_filling_disk, raising=False)
    with pytest.raises(OSError, match="No space left on device") as info:
        _extract_in_process(tiny_verifier_dir, prepared, failed, fingerprint)
    assert "shard-r000-00002" in str(info.value) and "rerun" in str(info.value)
    assert not list(failed.glob("*.tmp"))  # the partial file is removed: it only holds the space a user needs
    partial = FeatureDataset(failed, split="all")  # every committed shard is whole and checksummed
    assert len(partial) == 4
    monkeypatch.undo()
    _extract_in_process(tiny_verifier_dir, prepared, failed, fingerprint)
    names = sorted(p.name for p in full.iterdir())
    assert names == sorted(p.name for p in failed.iterdir())
    for name in names:
        if not name.endswith(".jsonl"):
            assert (full / name).read_bytes() == (failed / name).read_bytes(), name
    assert len(FeatureDataset(failed, split="all")) == 10
