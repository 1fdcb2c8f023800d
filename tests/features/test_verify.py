"""Shard checksums at scale: hashed on several threads, each shard recorded as it finishes, so a start killed in
the middle of hashing resumes with the shards it had not reached; a corrupt shard is named, the good ones kept."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import eagle3_hf.features.verify as verify
from eagle3_hf.features.records import make_header
from eagle3_hf.features.shard_writer import ShardWriter
from eagle3_hf.features.store import load_manifest, merge_manifests
from eagle3_hf.features.verify import STAMP, verify_shards

from tests.helpers.data import HashSpy

ROOT = Path(__file__).resolve().parents[2]
SHARDS = 6


def write_directory(out: Path, shards: int = SHARDS, hidden: int = 32) -> Path:
    """`shards` shards of 2 random samples each, through the store's own writer."""
    header = make_header({"name": "synthetic", "revision": None, "num_hidden_layers": 4, "hidden_size": hidden,
                          "vocab_size": 100}, "fp", (1, 2, 3), "bfloat16")
    writer = ShardWriter(out, header, samples_per_shard=2)
    g = torch.Generator().manual_seed(0)
    for i in range(2 * shards):
        n = 8 + i
        writer.add(f"s{i:03d}", torch.randint(0, 100, (n,), generator=g), torch.ones(n),
                   torch.randn(n, 3 * hidden, generator=g), torch.randn(n, hidden, generator=g),
                   torch.randint(0, 100, (n,), generator=g))
    writer.close()
    merge_manifests(out)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    return write_directory(tmp_path_factory.mktemp("verify") / "features")


def copied(written: Path, tmp_path: Path) -> Path:
    """A copy with its mtimes (rsync -a, cp -a): new inodes, so nothing vouches for its files yet."""
    return Path(shutil.copytree(written, tmp_path / "copy", ignore=shutil.ignore_patterns(STAMP)))


def test_shards_as_written_are_not_hashed(tmp_path, monkeypatch):
    d = write_directory(tmp_path / "features")
    spy = HashSpy()
    monkeypatch.setattr(verify, "sha256_file", spy)
    assert verify_shards(d, load_manifest(d)["shards"], "once") == 0
    assert spy.files == [] and not (d / STAMP).exists()
    assert verify_shards(d, load_manifest(d)["shards"], "always", threads=3) == SHARDS
    assert sorted(spy.files) == sorted(s["file"] for s in load_manifest(d)["shards"])


def test_threads_hash_every_shard_once_and_record_them(written, tmp_path, monkeypatch):
    d = copied(written, tmp_path)
    spy = HashSpy()
    monkeypatch.setattr(verify, "sha256_file", spy)
    shards = load_manifest(d)["shards"]
    assert verify_shards(d, shards, "once", threads=4) == SHARDS
    assert sorted(spy.files) == sorted(s["file"] for s in shards)
    assert sorted(json.loads((d / STAMP).read_text())["shards"]) == sorted(s["file"] for s in shards)
    assert verify_shards(d, shards, "once", threads=4) == 0


def test_a_corrupt_shard_is_named_and_the_good_ones_are_kept(written, tmp_path):
    d = copied(written, tmp_path)
    shards = load_manifest(d)["shards"]
    bad = d / shards[-1]["file"]
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0x01
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{bad.name} is corrupt"):
        verify_shards(d, shards, "once", threads=1)  # in manifest order: the last shard fails last
    assert sorted(json.loads((d / STAMP).read_text())["shards"]) == sorted(s["file"] for s in shards[:-1])


KILLED = """
import os, signal, sys, time, json
from pathlib import Path
import eagle3_hf.features.verify as verify
from eagle3_hf.features.store import load_manifest, sha256_file

d, k = Path(sys.argv[1]), int(sys.argv[2])
calls = 0

def hash_then_die(path):
    global calls
    calls += 1
    if calls > k:  # the record must already hold the k shards hashed before: then the start dies mid-hash
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if len(json.loads((d / verify.STAMP).read_text())["shards"]) >= k:
                    os.kill(os.getpid(), signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.01)
        sys.exit(3)  # the finished shards were never recorded
    return sha256_file(path)

verify.verify_shards(d, load_manifest(d)["shards"], "once", threads=1, record_every_s=0, hash_file=hash_then_die)
sys.exit(4)  # not killed
"""


def test_a_killed_hash_resumes_with_the_shards_it_had_not_reached(written, tmp_path, monkeypatch):
    d = copied(written, tmp_path)
    k = 2
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent(KILLED))
    proc = subprocess.run([sys.executable, str(script), str(d), str(k)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr  # SIGKILL, after the record held the first k shards
    shards = load_manifest(d)["shards"]
    recorded = json.loads((d / STAMP).read_text())["shards"]
    assert sorted(recorded) == sorted(s["file"] for s in shards[:k])
    spy = HashSpy()
    monkeypatch.setattr(verify, "sha256_file", spy)
    assert verify_shards(d, shards, "once", threads=2) == SHARDS - k
    assert sorted(spy.files) == sorted(s["file"] for s in shards[k:])


def test_a_record_of_other_bytes_is_not_trusted(written, tmp_path):
    """A record whose sha256 is not the manifest's (another extraction under the same name) counts for nothing."""
    d = copied(written, tmp_path)
    shards = load_manifest(d)["shards"]
    verify_shards(d, shards, "once")
    record = json.loads((d / STAMP).read_text())
    record["shards"][shards[0]["file"]]["sha256"] = "0" * 64
    (d / STAMP).write_text(json.dumps(record))
    assert verify_shards(d, shards, "once") == 1


def test_a_shard_changed_after_it_was_written_is_hashed_and_caught(tmp_path, monkeypatch):
    """Rewritten in place with its size and mtime put back: what the writer vouched for is not this file any more
    (its ctime moved), so `once` hashes that shard, and only that one."""
    import os

    d = write_directory(tmp_path / "features")
    shards = load_manifest(d)["shards"]
    shard = d / shards[1]["file"]
    time.sleep(0.05)  # past the filesystem's timestamp tick (the kernel's coarse clock)
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    spy = HashSpy()
    monkeypatch.setattr(verify, "sha256_file", spy)
    with pytest.raises(ValueError, match=f"{shard.name} is corrupt"):
        verify_shards(d, shards, "once")
    assert spy.files == [shard.name]
