"""The on-disk feature format: sharded safetensors, per-rank journals, one merged manifest.

A feature directory holds
  shard-r{rank:03d}-{idx:05d}.safetensors   many samples concatenated along tokens:
      input_ids int32 [N], loss_mask uint8 [N], verifier_greedy int32 [N],
      aux_hidden_states [N, 3H], last_hidden_state [N, H]   (bfloat16, float32, or float8_e4m3fn with
      aux_hidden_states_scale f32 [N, 3] and last_hidden_state_scale f32 [N, 1], one scale per H-row)
  manifest.r{rank:03d}.jsonl   the rank's journal: a header line, then one line per durable shard
  manifest.json                all journals merged (what readers open)

Why a journal: a shard file is written to a temporary name, fsynced and renamed, and only then is its line
appended (and fsynced) to the journal. A kill at any point leaves every journaled shard complete and
nothing else counted, so a restart resumes after the last journaled sample — no sample lost or duplicated,
and appending a line costs O(1) where rewriting a manifest per shard would cost O(samples).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import torch

from ..constants import MANIFEST
from ..errors import Eagle3Error
from .quantize import quantize
from .records import (
    FORMAT,
    HEADER_KEYS,
    SAMPLE_KEYS,
    VERIFIER_HASH_KEYS,
    VERSION,
    FeatureHeader,
    JournalRecord,
    Manifest,
    NodePart,
    SampleRecord,
    ShardRecord,
    canonical_dtype,
)

SHARD_RE = re.compile(r"^shard-r(\d{3})-(\d{5})\.safetensors$")


def shard_name(rank: int, idx: int) -> str:
    return f"shard-r{rank:03d}-{idx:05d}.safetensors"


def journal_name(rank: int) -> str:
    return f"manifest.r{rank:03d}.jsonl"


# ---------------------------------------------------------------- durable writes

def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, unique_tmp: bool = False) -> None:
    """Write to a temporary name, fsync, rename: a reader sees the old file or the whole new one. `unique_tmp`:
    a temporary name of this process and thread, for a file that several writers may replace at once."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp" if unique_tmp else path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        tmp.unlink(missing_ok=True)  # a partial file only holds space (a full disk needs it back)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256_file(path: Path, block: int = 1 << 24) -> str:
    """sha256 of a file, read into one reused buffer (hashlib and the read release the GIL: threads scale)."""
    h = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_stamp(path: Path) -> dict[str, int]:
    """What identifies one file's bytes without reading them: size, mtime, ctime and inode (verify.py says why)."""
    st = os.stat(path)
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


def sample_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over one sample's stored bytes, in SAMPLE_KEYS order (readers recompute it from the shard)."""
    h = hashlib.sha256()
    for key in SAMPLE_KEYS:
        if key in tensors:
            h.update(tensors[key].contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def stored_sample(input_ids: torch.Tensor, loss_mask: torch.Tensor, aux_hidden_states: torch.Tensor,
                  last_hidden_state: torch.Tensor, verifier_greedy: torch.Tensor, dtype: str
                  ) -> dict[str, torch.Tensor]:
    """One sample's tensors as a shard stores them (SAMPLE_KEYS, on the CPU): ids int32, mask uint8, the states
    rounded to `dtype` ([T, 3H], [T, H]; states already in `dtype` are not copied), fp8's per-row scales."""
    dtype = canonical_dtype(dtype)
    rows = aux_hidden_states.shape[-1] // last_hidden_state.shape[-1]
    aux, aux_scale = quantize(aux_hidden_states, rows, dtype)
    last, last_scale = quantize(last_hidden_state, 1, dtype)
    tensors = {"input_ids": input_ids.to(torch.int32), "loss_mask": loss_mask.to(torch.uint8),
               "verifier_greedy": verifier_greedy.to(torch.int32), "aux_hidden_states": aux,
               "last_hidden_state": last}
    if aux_scale is not None and last_scale is not None:  # both or neither (the dtype decides)
        tensors["aux_hidden_states_scale"] = aux_scale
        tensors["last_hidden_state_scale"] = last_scale
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


# ---------------------------------------------------------------- header checks and journals

def header_differs(existing: Mapping[str, Any], new: Mapping[str, Any], key: str) -> bool:
    """Whether two headers disagree on `key`. The verifier's hashes count only where both record them: a
    directory begun before they were recorded is resumed (and keeps its header)."""
    a, b = existing.get(key), new.get(key)
    if key == "verifier" and isinstance(a, dict) and isinstance(b, dict):
        both = [k for k in VERIFIER_HASH_KEYS if k in a and k in b]
        strip = [k for k in VERIFIER_HASH_KEYS if k not in both]
        return {k: v for k, v in a.items() if k not in strip} != {k: v for k, v in b.items() if k not in strip}
    return a != b


def check_header(existing: Mapping[str, Any], new: Mapping[str, Any], where: str) -> None:
    """Refuse to mix features from another verifier, tokenizer, layer set or dtype in one directory."""
    for key in HEADER_KEYS:
        if header_differs(existing, new, key):
            raise ValueError(
                f"{where} holds features with {key}={existing.get(key)!r}, but this run has {key}={new.get(key)!r}; "
                f"refusing to mix them in one directory (use a new --output)"
            )


def journal_entries(raw: bytes) -> Iterator[tuple[int, Any]]:
    """(byte length of its line, parsed entry) for each line of journal bytes, in order, up to the first line
    that is torn (no newline: a writer killed mid-append, or still appending) or not JSON; nothing from that
    line on is yielded."""
    for line in raw.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            return
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            return
        yield len(line), entry


def read_journal(path: Path, repair: bool = False) -> tuple[FeatureHeader | None, list[JournalRecord]]:
    """(header, records) of one journal. A torn last line (killed mid-append) is ignored, or cut if repair."""
    header: FeatureHeader | None = None
    records: list[JournalRecord] = []
    good_bytes = 0
    with open(path, "rb") as f:
        raw = f.read()
    for size, entry in journal_entries(raw):
        good_bytes += size
        if "header" in entry:
            header = entry["header"]
        else:
            records.append(entry)
    if repair and good_bytes < len(raw):
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
            f.flush()
            os.fsync(f.fileno())
    return header, records


def journals(out_dir: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for path in glob.glob(str(Path(out_dir) / "manifest.r*.jsonl")):
        m = re.search(r"manifest\.r(\d{3})\.jsonl$", path)
        if m:
            found[int(m.group(1))] = Path(path)
    return dict(sorted(found.items()))


def merge_manifests(out_dir: str | Path, write: bool = True, missing: int = 0,
                    node_part: NodePart | None = None) -> Manifest:
    """Merge every rank's journal into one manifest (shards in file-name order), written atomically. `missing`:
    samples of the dataset no rank has written or skipped yet (a merge that stopped waiting), recorded so that
    readers refuse the manifest as unfinished (load_manifest). `node_part`: the journals are one node's ranks'
    (a directory local to that node), recorded so that only a run over every node's part reads it."""
    out_dir = Path(out_dir)
    header: FeatureHeader | None = None
    shards: list[ShardRecord] = []
    samples: list[SampleRecord] = []
    skipped: dict[str, list[str]] = {}  # reason -> sample ids
    for path in journals(out_dir).values():
        rank_header, records = read_journal(path)
        if rank_header is None:
            continue
        if header is None:
            header = rank_header
        else:
            check_header(header, rank_header, str(path))
        for rec in records:
            shard = rec.get("shard")
            if shard:
                shards.append(shard)
                samples.extend(rec["samples"])
            for reason, ids in rec.get("skipped", {}).items():
                skipped.setdefault(reason, []).extend(ids)
    if header is None:
        raise FileNotFoundError(f"{out_dir}: no features here (no manifest.json and no manifest.r*.jsonl journal)")
    order = {s["file"]: i for i, s in enumerate(sorted(shards, key=lambda s: s["file"]))}
    shards.sort(key=lambda s: s["file"])
    samples.sort(key=lambda s: (order[s["shard"]], s["offset"]))
    ids = [s["id"] for s in samples]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{out_dir}: sample id {dup!r} appears in more than one shard")
    # the header's keys, then the merge's (cast: a header read from disk could hold any key, no merge key)
    manifest = cast(Manifest, {**header, "shards": shards, "samples": samples,
                               "skipped": {k: len(v) for k, v in sorted(skipped.items())},
                               "skipped_ids": {k: v for k, v in sorted(skipped.items())}})
    if missing:
        manifest["missing_samples"] = int(missing)
    if node_part is not None:
        manifest["node_part"] = node_part
    if write:
        atomic_write_bytes(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


class PartialFeaturesError(Eagle3Error):
    """A feature directory whose extraction has not finished (still running, or stopped): part of the data."""


_warned_partial: set[str] = set()


def read_manifest(features_dir: str | Path) -> Manifest:
    """manifest.json, or the journals merged in memory: what a writer resuming an extraction reads. Readers that
    train or evaluate use load_manifest, which refuses an unfinished extraction."""
    path = Path(features_dir) / MANIFEST
    if path.is_file():
        with open(path, encoding="utf-8") as f:
            manifest: Manifest = json.load(f)
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{path}: not an eagle3_hf feature manifest (format={manifest.get('format')!r})")
        if manifest.get("version") != VERSION:
            raise ValueError(f"{path}: feature format version {manifest.get('version')} is not supported ({VERSION})")
        return manifest
    manifest = merge_manifests(features_dir, write=False)
    manifest["unfinished"] = True  # journals only: no merge has declared the extraction done
    return manifest


def load_manifest(features_dir: str | Path, allow_partial: bool = False, node_part: bool = False) -> Manifest:
    """The manifest of a finished extraction. One that has not finished (no manifest.json, only the journals of a
    run still writing or stopped; or a manifest merged with samples missing) is part of the data: refused in one
    line (PartialFeaturesError) unless `allow_partial`, which reads what is there and says how much on stderr.
    One node's part of a multi-node extraction is refused the same way unless `node_part` (a training run over
    every node's part: train/nodes.py checks that the parts make the dataset)."""
    manifest = read_manifest(features_dir)
    part = manifest.get("node_part")
    if part and not node_part:
        what = (f"node {part['node']}'s part of an extraction over {part['nodes']} nodes ({len(manifest['samples'])} "
                f"of {part['dataset_samples']} samples)")
        if not allow_partial:
            raise PartialFeaturesError(
                f"{features_dir}: {what}: train on all {part['nodes']} nodes with --per-node-features, or copy every "
                "node's shard-* and manifest.r*.jsonl files into one directory and rerun the extract command there "
                "in one process to merge them")
        if str(features_dir) not in _warned_partial:
            _warned_partial.add(str(features_dir))
            print(f"[features] warning: {features_dir}: {what}: using this part only (--allow-partial-features)",
                  file=sys.stderr)
    missing = int(manifest.get("missing_samples") or 0)
    if not manifest.get("unfinished") and not missing:
        return manifest
    found = len(manifest["samples"])
    done = found + sum(int(n) for n in manifest.get("skipped", {}).values())
    held = f"{found} of {done + missing} samples" if missing else f"{found} samples"
    where = (f"its manifest lists {held}, {missing} not yet extracted" if missing
             else f"no manifest.json; its journals hold {held}")
    if not allow_partial:
        raise PartialFeaturesError(f"{features_dir}: an unfinished extraction ({where}): rerun the extract command "
                                   "to finish it, or pass --allow-partial-features to use what is there")
    if str(features_dir) not in _warned_partial:
        _warned_partial.add(str(features_dir))
        print(f"[features] warning: {features_dir}: an unfinished extraction ({where}): using {held} "
              "(--allow-partial-features)", file=sys.stderr)
    return manifest


def dist_env() -> tuple[int, int]:
    """(rank, world_size) as torchrun and accelerate launch set them."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def wait_and_merge(out_dir: Path, all_ids: list[str], timeout_s: float | None, poll_s: float = 2.0,
                   node_part: NodePart | None = None) -> Manifest:
    """Rank 0: merge once every sample of the dataset is written or skipped by some rank (with `node_part`: a
    node's first process, once every sample of its node's ranks is)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    want = set(all_ids)
    told = False
    while True:
        manifest = merge_manifests(out_dir, write=False)
        done = {s["id"] for s in manifest["samples"]}
        for ids in manifest.get("skipped_ids", {}).values():
            done.update(ids)
        if want <= done or (deadline is not None and time.monotonic() > deadline):
            if not want <= done:
                print(f"[extract] {len(want - done)} samples still missing after {timeout_s}s; writing a partial "
                      f"manifest (re-run the same command to finish and merge)", file=sys.stderr)
            return merge_manifests(out_dir, write=True, missing=len(want - done), node_part=node_part)
        if not told:
            print(f"[extract] rank 0 done; waiting for {len(want - done)} samples of the other ranks to merge "
                  f"{out_dir}/manifest.json", file=sys.stderr)
            told = True
        time.sleep(poll_s)
