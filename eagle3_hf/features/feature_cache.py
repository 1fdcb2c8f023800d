"""`--cache-features DIR` with `--features`: what the feature server sent is kept, in extract's format.

The first time a sample is needed its states come from the server; the collator rounds them to the storage
dtype (quantize.quantize) and this cache commits them through the same ShardWriter `extract` uses, so DIR is
an ordinary feature directory (checksummed safetensors shards, per-writer journals; FeatureDataset reads
it; `manifest.json` is merged at the end of training and removed by the next write, so it is never stale).
A sample in DIR is read back instead of fetched: the stored bits are the ones the online batch is rounded
to, so a row is bit-identical either way.

Several writers at once (DDP ranks, their DataLoader workers, an evaluation loader): each process claims its
own journal prefix `manifest.rNNN.jsonl` with an exclusive lock on `writer.rNNN.lock` (released by the
kernel when the process dies), and commits under `commit.lock` after re-reading the journals, so a sample two
processes fetched at once (accelerate's even_batches repeats the last samples) is written once. Each
batch's new samples are committed (shard, then journal line, both fsynced) before the batch is returned: a
kill leaves every journaled shard whole and nothing else counted, and the rerun fetches only the rest.
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import IO, Any

import torch

from ..constants import MANIFEST
from ..errors import Eagle3Error
from .quantize import carried
from .records import HEADER_KEYS, FeatureHeader, Manifest, SampleRecord
from .shard_writer import ShardWriter
from .store import header_differs, journal_entries, journals, merge_manifests, read_journal, sample_sha256

MAX_WRITERS = 1000  # journal prefixes are three digits


class FeatureCacheError(Eagle3Error):
    """DIR holds features of another verifier / tokenizer / dtype, or a cached sample that does not match."""


class FeatureCache:
    """One feature directory shared by every process of a run: `get` what is there, `put` what was fetched."""

    def __init__(self, cache_dir: str | Path, header: FeatureHeader, samples_per_shard: int = 64) -> None:
        self.dir, self.samples_per_shard = Path(cache_dir), int(samples_per_shard)
        self.header = FeatureHeader(**header)  # a copy
        self.dir.mkdir(parents=True, exist_ok=True)
        self.check()
        self._pid: int | None = None  # per-process state below is rebuilt after a fork

    # ------------------------------------------------------------ identity

    def check(self) -> None:
        """Refuse (one line naming DIR) features written for another verifier, tokenizer, layer set or dtype."""
        found: list[tuple[str, FeatureHeader]] = []
        if (self.dir / MANIFEST).is_file():
            with open(self.dir / MANIFEST, encoding="utf-8") as f:
                found.append((MANIFEST, json.load(f)))
        for path in journals(self.dir).values():
            journal_header = read_journal(path)[0]
            if journal_header is not None:
                found.append((path.name, journal_header))
        for name, header in found:
            differ = [k for k in HEADER_KEYS if header_differs(header, self.header, k)]
            if differ:
                what = "; ".join(f"{k} {header.get(k)!r} (this run: {self.header.get(k)!r})" for k in differ)
                raise FeatureCacheError(f"--cache-features {self.dir} holds features with {what} ({name}): "
                                        "choose another directory for this verifier and dataset")

    # ------------------------------------------------------------ per process

    def _state(self) -> None:
        """This process's journal prefix, writer and index (opened on first use, again after a fork)."""
        if self._pid == os.getpid():
            return
        self._pid = os.getpid()
        self._index: dict[str, SampleRecord] = {}  # sample id -> its journal record
        self._read_to: dict[Path, int] = {}  # journal -> bytes parsed
        self._claim: IO[bytes] | None = None
        for rank in range(MAX_WRITERS):
            lock = open(self.dir / f"writer.r{rank:03d}.lock", "a+b")  # noqa: SIM115 (held for the process's life)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            self._claim, self.rank = lock, rank
            break
        if self._claim is None:
            raise FeatureCacheError(f"--cache-features {self.dir}: {MAX_WRITERS} writers already hold it")
        with self._commit_lock():
            self.writer = ShardWriter(self.dir, self.header, rank=self.rank, samples_per_shard=self.samples_per_shard)
        self.refresh()

    def _commit_lock(self) -> AbstractContextManager[None]:
        dir_ = self.dir

        class Lock:
            def __enter__(self) -> None:
                self.f = open(dir_ / "commit.lock", "a+b")  # noqa: SIM115
                fcntl.flock(self.f, fcntl.LOCK_EX)

            def __exit__(self, *exc: object) -> None:
                fcntl.flock(self.f, fcntl.LOCK_UN)
                self.f.close()

        return Lock()

    def refresh(self) -> None:
        """Read the journal lines written since the last refresh (any process's); a torn last line waits."""
        for path in journals(self.dir).values():
            start = self._read_to.get(path, 0)
            with open(path, "rb") as f:
                f.seek(start)
                raw = f.read()
            for size, entry in journal_entries(raw):
                start += size
                for s in entry.get("samples", []):
                    self._index.setdefault(s["id"], s)
            self._read_to[path] = start

    def __contains__(self, sample_id: str) -> bool:
        self._state()
        return sample_id in self._index

    # ------------------------------------------------------------ read and write

    def get(self, sample_ids: list[str], input_ids: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """{id: features} of the ids in DIR (rounded as stored, float32; verifier_greedy int64), checked against
        the stored sha256 and the prepared tokens."""
        from safetensors import safe_open

        self._state()
        if any(sid not in self._index for sid in sample_ids):
            self.refresh()
        by_shard: dict[str, list[SampleRecord]] = {}
        for sid in sample_ids:
            if sid in self._index:
                by_shard.setdefault(self._index[sid]["shard"], []).append(self._index[sid])
        out: dict[str, dict[str, torch.Tensor]] = {}
        for shard, records in by_shard.items():
            path = self.dir / shard
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                for rec in records:
                    a, b = rec["offset"], rec["offset"] + rec["length"]
                    t = {k: f.get_slice(k)[a:b] for k in keys}
                    if sample_sha256(t) != rec["sha256"]:
                        raise FeatureCacheError(f"--cache-features {self.dir}: sample {rec['id']!r} in {path} is "
                                                "corrupt (sha256 mismatch): remove that shard's journal line or DIR")
                    if not torch.equal(t["input_ids"].long(), input_ids[rec["id"]]):
                        raise FeatureCacheError(f"--cache-features {self.dir}: sample {rec['id']!r} holds other tokens "
                                                "than --prepared-dir's: a cache belongs to one prepared dataset")
                    out[rec["id"]] = {
                        "aux_hidden_states": carried(t["aux_hidden_states"], t.get("aux_hidden_states_scale")),
                        "last_hidden_state": carried(t["last_hidden_state"], t.get("last_hidden_state_scale")),
                        "verifier_greedy": t["verifier_greedy"].long()}
        return out

    def put(self, samples: dict[str, dict[str, torch.Tensor]]) -> int:
        """Commit fetched samples (input_ids, loss_mask and the unrounded features) not yet in DIR, durably,
        before returning; the number written."""
        self._state()
        written = 0
        with self._commit_lock():
            self.refresh()
            for sid, s in samples.items():
                if sid in self._index or sid in self.writer.done_ids:
                    continue
                self.writer.add(sid, s["input_ids"], s["loss_mask"], s["aux_hidden_states"], s["last_hidden_state"],
                                s["verifier_greedy"])
                written += 1
            self.writer.flush()
            self.writer.wait()
            if written:  # a merged manifest.json no longer lists everything: readers merge the journals
                (self.dir / MANIFEST).unlink(missing_ok=True)
            self.refresh()
        return written

    def finish(self) -> Manifest:
        """Merge every journal into manifest.json (call once, when no process writes any more)."""
        return merge_manifests(self.dir)

    def __getstate__(self) -> dict[str, Any]:  # a spawned DataLoader worker opens its own prefix and writer
        return {k: self.__dict__[k] for k in ("dir", "header", "samples_per_shard")} | {"_pid": None}
