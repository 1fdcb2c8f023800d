"""Shard checksums, checked once per feature directory rather than by every rank at every start.

Hashing is the only full read of a feature directory (924 GB for the reference run): done at every (re)start it
delays step 1 by the time it takes to read the directory. So with `once` (the default) a shard is hashed only
when nothing vouches for the very file on disk:

- the writer vouches for it: `ShardWriter` hashes a shard's bytes in memory, writes them, fsyncs, renames, and
  then records the file's `written` stat (mtime_ns, ctime_ns, inode) beside its size and sha256 in the journal,
  hence the manifest. Reading the file back at that point would read the page cache, the same bytes, so it would
  prove nothing more. The same stat later means the same file, untouched since: no user-space write, rename,
  copy or restore leaves size, mtime, ctime and inode all unchanged (ctime cannot be set back);
- or an earlier reader vouches for it: `verified.json` beside the manifest records each shard hashed here, keyed
  on the same stat and the manifest's sha256, one shard at a time as it finishes (a killed start resumes).

Anything else (a copied or synced directory: new inodes; a rewritten, truncated or replaced shard; a record
from another manifest) is hashed, on `threads` threads (hashlib releases the GIL). What `once` cannot see is a
change below the filesystem that leaves every stat field alone (a disk's bit rot): `always` hashes every shard
every time; `never` checks sizes only. A read-only directory is hashed at each start, and says why once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from .records import ShardRecord
from .store import atomic_write_bytes, file_stamp, sha256_file

STAMP = "verified.json"
MODES = ("once", "always", "never")
MAX_THREADS = 16  # readers of one node's disk; more rarely helps a local NVMe array, a network filesystem may want it
RECORD_EVERY_S = 1.0  # verified.json is rewritten at most this often while hashing (and once at the end)
logger = logging.getLogger(__name__)


def default_threads() -> int:
    """Hashing threads when none are asked for: the machine's cores, at most MAX_THREADS (the other ranks of the
    node wait in a barrier meanwhile, so the cores are free)."""
    return max(1, min(MAX_THREADS, os.cpu_count() or 1))


def _key(path: Path, shard: ShardRecord) -> dict[str, Any]:
    return {**file_stamp(path), "sha256": shard["sha256"]}


def vouched_by_writer(shard: ShardRecord, key: Mapping[str, Any]) -> bool:
    """Whether the file is the one the writer hashed: its size and written stat unchanged since (module docstring)."""
    written = shard.get("written")
    if not isinstance(written, dict):
        return False  # a shard written before the stat was recorded
    return key["bytes"] == shard["bytes"] and all(key.get(k) == written.get(k) for k in ("mtime_ns", "ctime_ns", "ino"))


class _Record:
    """verified.json as it grows: rewritten atomically at most every `every_s` seconds, and at `flush`."""

    def __init__(self, path: Path, shards: dict[str, dict[str, Any]], every_s: float, warn: bool) -> None:
        self.path, self.shards, self.every_s, self.warn = path, shards, every_s, warn
        self.lock = threading.Lock()
        self.last = time.monotonic()
        self.dirty = self.broken = False

    def add(self, name: str, key: dict[str, Any]) -> None:
        with self.lock:
            self.shards[name] = key
            self.dirty = True
            if time.monotonic() - self.last >= self.every_s:
                self._write()

    def flush(self) -> None:
        with self.lock:
            if self.dirty:
                self._write()

    def _write(self) -> None:
        self.last, self.dirty = time.monotonic(), False
        if self.broken:
            return
        try:  # a name of its own: two nodes' main processes may record one shared directory at once
            atomic_write_bytes(self.path, json.dumps({"shards": self.shards}, indent=1).encode(), unique_tmp=True)
        except OSError as exc:  # a read-only dataset: every start hashes again
            self.broken = True
            if self.warn:
                logger.warning("%s: cannot record verified shards (%s); they will be hashed again at the next "
                               "start", self.path.parent, exc.strerror or exc)


def read_record(features_dir: Path) -> dict[str, Any]:
    """verified.json's shards; empty when it is missing, unreadable or foreign (everything is checked again)."""
    path = features_dir / STAMP
    if not path.is_file():
        return {}
    try:
        shards = json.loads(path.read_text(encoding="utf-8")).get("shards", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return shards if isinstance(shards, dict) else {}


def verify_shards(features_dir: Path, shards: Iterable[ShardRecord], mode: str = "once", threads: int | None = None,
                  record_every_s: float = RECORD_EVERY_S,
                  hash_file: Callable[[Path], str] | None = None) -> int:
    """Check each shard's sha256 against the manifest (`mode` as the module docstring says) on `threads` threads
    (default `default_threads`); returns how many shards were hashed. A mismatch raises ValueError naming the
    shard, after recording the shards that did match. `hash_file`: sha256 of one file (default store.sha256_file)."""
    if mode not in MODES:
        raise ValueError(f"verify mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "never":
        return 0
    features_dir = Path(features_dir)
    record = read_record(features_dir) if mode == "once" else {}
    known: dict[str, dict[str, Any]] = {}
    todo: list[tuple[ShardRecord, dict[str, Any]]] = []
    for shard in shards:
        key = _key(features_dir / shard["file"], shard)
        if mode == "once" and (record.get(shard["file"]) == key or vouched_by_writer(shard, key)):
            if record.get(shard["file"]) == key:
                known[shard["file"]] = key
            continue
        todo.append((shard, key))
    if not todo:
        return 0
    out = _Record(features_dir / STAMP, known, record_every_s, warn=mode == "once")
    hashed = 0
    pool = ThreadPoolExecutor(max_workers=max(1, min(threads or default_threads(), len(todo))),
                              thread_name_prefix="eagle3-verify")
    pending: dict[Future[str], tuple[ShardRecord, dict[str, Any]]] = {}
    try:
        digest_of = hash_file or sha256_file
        pending = {pool.submit(digest_of, features_dir / shard["file"]): (shard, key) for shard, key in todo}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            corrupt = None
            for future in done:  # every finished shard is recorded before a corrupt one among them stops the run
                shard, key = pending.pop(future)
                digest = future.result()
                hashed += 1
                if digest == shard["sha256"]:
                    out.add(shard["file"], key)
                elif corrupt is None:
                    corrupt = (f"shard {features_dir / shard['file']} is corrupt: sha256 {digest[:16]}... != "
                               f"manifest {shard['sha256'][:16]}...")
            if corrupt is not None:
                raise ValueError(corrupt)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        out.flush()
    return hashed
