"""`ShardWriter`: samples into shards committed durably (file, then journal line), the one writer of every
offline route. The format it writes, and why a journal makes a kill at any point safe: store.py."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_save

from ..constants import MANIFEST
from .records import FORMAT, FeatureHeader, JournalRecord, canonical_dtype
from .store import (
    SHARD_RE,
    atomic_write_bytes,
    check_header,
    file_stamp,
    fsync_dir,
    journal_name,
    journals,
    read_journal,
    read_manifest,
    sample_sha256,
    shard_name,
    stored_sample,
)


class _Turn:
    """One commit's place in the journal's order: `done` once it has journaled or given up, `journaled` if it did."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.journaled = False


class ShardWriter:
    """Accumulates samples into shards and commits each one durably (file, then journal line).

    One writer per rank. Opening a directory that already holds features checks that the header matches
    and exposes `done_ids` (samples written or skipped by any rank) so a restart continues where it stopped.
    Shards are serialised in a background thread so the verifier keeps running while one is written; with
    `writers` > 1, that many shards are serialised, hashed and written at once (a source faster than one thread
    can hash and write: vLLM's readers) and still journaled strictly in order, so a kill leaves the journaled
    shards contiguous and the unjournaled files are removed at the restart, as with one.
    """

    def __init__(self, out_dir: str | Path, header: FeatureHeader, rank: int = 0, samples_per_shard: int = 64,
                 max_shard_bytes: int = 1 << 30, writers: int = 1) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.header, self.rank = header, rank
        self.samples_per_shard, self.max_shard_bytes = max(1, samples_per_shard), max_shard_bytes
        self.dtype = canonical_dtype(header["dtype"])
        manifest_path = self.out_dir / MANIFEST
        # a manifest.json lists what was there: the first commit removes it (readers then see journals only,
        # an unfinished extraction, until the end of the run merges them again)
        self._manifest_on_disk = manifest_path.is_file()
        if self._manifest_on_disk:
            check_header(read_manifest(self.out_dir), header, str(manifest_path))
        self.done_ids: set[str] = set()
        self.next_idx = 0
        for r, path in journals(self.out_dir).items():
            rank_header, records = read_journal(path, repair=(r == rank))
            if rank_header is not None:
                check_header(rank_header, header, str(path))
            for rec in records:
                self.done_ids.update(s["id"] for s in rec.get("samples", []))
                for ids in rec.get("skipped", {}).values():
                    self.done_ids.update(ids)
                if r == rank and rec.get("shard"):
                    self.next_idx += 1
        self.journal = self.out_dir / journal_name(rank)
        if not self.journal.is_file() or read_journal(self.journal)[0] is None:
            atomic_write_bytes(self.journal, (json.dumps({"header": header}) + "\n").encode())
        self._remove_uncommitted()
        self._pending: list[dict[str, torch.Tensor]] = []
        self._pending_ids: list[str] = []
        self._pending_sha: list[str | None] = []
        self._pending_bytes = 0
        self._skipped: dict[str, list[str]] = {}
        self.skipped_counts: dict[str, int] = {}
        self.written_samples = self.written_tokens = 0
        self._writers = max(1, int(writers))
        self._pool = ThreadPoolExecutor(max_workers=self._writers, thread_name_prefix="eagle3-shard-writer")
        self._futures: deque[Future[None]] = deque()  # commits submitted, oldest first
        self._turn: _Turn | None = None  # the last submitted commit's

    def _remove_uncommitted(self) -> None:
        """Temp files and shards this rank wrote but never journaled (they will be rewritten identically)."""
        for path in self.out_dir.glob(f"shard-r{self.rank:03d}-*"):
            m = SHARD_RE.match(path.name)
            if path.name.endswith(".tmp") or (m and int(m.group(2)) >= self.next_idx):
                path.unlink()

    def add(self, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
            last_hidden_state: torch.Tensor, verifier_greedy: torch.Tensor) -> bool:
        """Queue one sample ([T], [T], [T, 3H], [T, H], [T]); False (and counted) if it holds NaN/Inf."""
        if sample_id in self.done_ids:
            raise ValueError(f"sample {sample_id!r} is already in {self.out_dir}")
        if not (torch.isfinite(aux_hidden_states).all() and torch.isfinite(last_hidden_state).all()):
            self.skip(sample_id, "nan_or_inf")
            return False
        self.add_stored(sample_id, stored_sample(input_ids, loss_mask, aux_hidden_states, last_hidden_state,
                                                 verifier_greedy, self.dtype))
        return True

    def add_stored(self, sample_id: str, tensors: dict[str, torch.Tensor], sha256: str | None = None) -> None:
        """Queue one sample already in its stored form (`stored_sample`, checked finite by the caller), with its
        `sample_sha256` when the caller computed it (vLLM's readers do, in parallel; else the commit does)."""
        if sample_id in self.done_ids:
            raise ValueError(f"sample {sample_id!r} is already in {self.out_dir}")
        n = tensors["input_ids"].shape[0]
        for k, v in tensors.items():
            if v.shape[0] != n:
                raise ValueError(f"sample {sample_id!r}: {k} has {v.shape[0]} rows, input_ids has {n}")
        self._pending.append(tensors)
        self._pending_ids.append(sample_id)
        self._pending_sha.append(sha256)
        self._pending_bytes += sum(v.numel() * v.element_size() for v in tensors.values())
        self.done_ids.add(sample_id)
        if len(self._pending) >= self.samples_per_shard or self._pending_bytes >= self.max_shard_bytes:
            self.flush()

    def skip(self, sample_id: str, reason: str) -> None:
        """Record a sample that will not be written; it is journaled with the next shard and counted."""
        self._skipped.setdefault(reason, []).append(sample_id)
        self.skipped_counts[reason] = self.skipped_counts.get(reason, 0) + 1
        self.done_ids.add(sample_id)

    def flush(self) -> None:
        """Hand the pending samples to a writer thread as one shard (waits while `writers` shards are in flight)."""
        if not self._pending and not self._skipped:
            return
        job = (self.next_idx if self._pending else None, self._pending, self._pending_ids, self._skipped,
               self._pending_sha)
        if self._pending:
            self.next_idx += 1
        self._pending, self._pending_ids, self._pending_sha, self._pending_bytes, self._skipped = [], [], [], 0, {}
        while len(self._futures) >= self._writers:
            self._futures.popleft().result()  # re-raises a failed write here
        after, self._turn = self._turn, _Turn()
        self._futures.append(self._pool.submit(self._commit, *job, after, self._turn))

    def wait(self) -> None:
        while self._futures:
            self._futures.popleft().result()  # re-raises a failed write here

    def _commit(self, idx: int | None, samples: list[dict[str, torch.Tensor]], ids: list[str],
                skipped: dict[str, list[str]], shas: list[str | None], after: _Turn | None, turn: _Turn) -> None:
        """Write one shard, then, once the commit before it has journaled (`after`), its journal line. After a
        failed commit the later ones write their files but journal nothing: the journal never has a gap."""
        try:
            turn.journaled = self._write_and_journal(idx, samples, ids, skipped, shas, after)
        finally:
            turn.done.set()

    def _write_and_journal(self, idx: int | None, samples: list[dict[str, torch.Tensor]], ids: list[str],
                           skipped: dict[str, list[str]], shas: list[str | None], after: _Turn | None) -> bool:
        record: JournalRecord = {"shard": None, "samples": [], "skipped": skipped}
        offset = 0
        if self._manifest_on_disk:
            (self.out_dir / MANIFEST).unlink(missing_ok=True)
            fsync_dir(self.out_dir)
            self._manifest_on_disk = False
        if idx is not None:
            name = shard_name(self.rank, idx)
            tensors = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
            data = safetensors_save(tensors, metadata={"format": FORMAT})
            del tensors  # several commits at once: hold the serialised bytes only
            try:
                atomic_write_bytes(self.out_dir / name, data)
            except OSError as exc:
                raise OSError(exc.errno, f"{exc.strerror or exc} while writing {self.out_dir / name}; the shards "
                              "before it are complete: rerun the same command to resume") from exc
            for sample_id, s, sha in zip(ids, samples, shas):
                length = s["input_ids"].shape[0]
                record["samples"].append({"id": sample_id, "shard": name, "offset": offset, "length": length,
                                          "sha256": sha or sample_sha256(s)})
                offset += length
            # the stat of the file just renamed into place: a reader finding it unchanged need not hash it again
            stamp = file_stamp(self.out_dir / name)
            record["shard"] = {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
                               "num_samples": len(samples), "num_tokens": offset,
                               "written": {k: stamp[k] for k in ("mtime_ns", "ctime_ns", "ino")}}
        if after is not None:
            after.done.wait()  # journal lines in shard order
            if not after.journaled:
                return False
        if idx is not None:
            self.written_samples += len(samples)
            self.written_tokens += offset
        with open(self.journal, "ab") as f:
            f.write((json.dumps(record) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        return True

    def close(self) -> None:
        """Commit everything pending and stop the writer thread."""
        try:
            self.flush()
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
