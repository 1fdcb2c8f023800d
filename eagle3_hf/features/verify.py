"""Shard checksums, verified once per feature directory rather than by every rank at every start.

Hashing is the only full read of a feature directory (924 GB for the reference run): done by every rank of an
8-GPU job at every (re)start, it delays step 1 by the time it takes to read the directory eight times. With
`once`, the first reader hashes each shard and records it in `verified.json` beside the manifest, keyed on the
shard's name, size, mtime and manifest checksum; a later reader re-hashes only a shard whose size or mtime
changed (rewritten, truncated, replaced) or that the record lacks. `always` hashes every shard every time (a
bit flip that leaves size and mtime alone is only caught this way); `never` checks sizes only. A read-only
directory is verified as `always` would, and says why once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .records import ShardRecord
from .store import atomic_write_bytes, sha256_file

STAMP = "verified.json"
MODES = ("once", "always", "never")
logger = logging.getLogger(__name__)


def _key(path: Path, shard: ShardRecord) -> dict[str, Any]:
    st = path.stat()
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": shard["sha256"]}


def verify_shards(features_dir: Path, shards: Iterable[ShardRecord], mode: str = "once") -> int:
    """Check each shard's sha256 against the manifest (`mode` as the module docstring says); returns how many
    shards were hashed. A mismatch raises ValueError naming the shard."""
    if mode not in MODES:
        raise ValueError(f"verify mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "never":
        return 0
    stamp_path = features_dir / STAMP
    record: dict[str, Any] = {}
    if mode == "once" and stamp_path.is_file():
        try:
            record = json.loads(stamp_path.read_text(encoding="utf-8")).get("shards", {})
        except (OSError, ValueError, AttributeError):
            record = {}  # unreadable or foreign: verify everything again and rewrite it
    hashed, verified = 0, {}
    for shard in shards:
        path = features_dir / shard["file"]
        key = _key(path, shard)
        if mode == "once" and record.get(shard["file"]) == key:
            verified[shard["file"]] = key
            continue
        digest = sha256_file(path)
        hashed += 1
        if digest != shard["sha256"]:
            raise ValueError(f"shard {path} is corrupt: sha256 {digest[:16]}... != manifest {shard['sha256'][:16]}...")
        verified[shard["file"]] = key
    if mode == "once" and hashed:
        try:
            atomic_write_bytes(stamp_path, json.dumps({"shards": verified}, indent=1).encode())
        except OSError as exc:  # a read-only dataset: every start hashes again
            logger.warning("%s: cannot record verified shards (%s); they will be hashed again at the next start",
                           features_dir, exc.strerror or exc)
    return hashed

