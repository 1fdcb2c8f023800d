"""The loader at scale: shard checksums read once per directory (not by every rank at every start; not at all for
shards as their writer left them), a changed shard still caught, features carried to the device in their storage
dtype with the values float32 would hold, and DataLoader workers where CUDA is present."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from eagle3_hf.features.packing import PackedCollator, PackedDataset
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.routes.transformers import extract_features
from eagle3_hf.features.store import file_stamp
from eagle3_hf.features.verify import STAMP
from eagle3_hf.features.write import StoreOptions
from eagle3_hf.train.arguments import loader_defaults
from eagle3_hf.train.loss import drafter_loss

from tests.helpers.data import make_prepared
from tests.helpers.drafters import HIDDEN, VOCAB, tiny_model
from tests.helpers.verifiers import make_tiny_verifier


@pytest.fixture(scope="module")
def verifier():
    return make_tiny_verifier(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=6)  # the tiny drafter's widths


@pytest.fixture(scope="module")
def root(tmp_path_factory, verifier, fingerprint):
    root = tmp_path_factory.mktemp("loader")
    prepared = make_prepared(root / "prep", fingerprint, n=14, lo=3, hi=30, vocab=VOCAB)
    for dtype in ("bf16", "fp8"):
        extract_features(verifier, fingerprint, prepared, root / dtype, dtype=dtype, store=StoreOptions(4),
                         progress=False)
    return root


def _fresh(root, dtype, tmp_path):
    return shutil.copytree(root / dtype, tmp_path / dtype)


def test_shards_are_hashed_once_per_directory(root, tmp_path):
    """A copy (new inodes: what its writer vouched for is not this file) is hashed by its first reader, once."""
    d = _fresh(root, "bf16", tmp_path)
    shards = len(FeatureDataset(d, verify="none").manifest["shards"])
    assert shards > 1
    assert FeatureDataset(d).hashed_shards == shards  # the first reader (rank 0) reads every byte once
    assert (d / STAMP).is_file()
    assert FeatureDataset(d).hashed_shards == 0  # every later start, every other rank: sizes only
    assert FeatureDataset(d, verify="shard").hashed_shards == shards  # --verify-features always


def test_shards_as_written_need_no_hashing(root):
    """The writer hashed each shard's bytes before writing them: unchanged since, nothing is read again."""
    ds = FeatureDataset(root / "bf16", split="all")
    assert ds.hashed_shards == 0 and all("written" in s for s in ds.manifest["shards"])


def test_a_shard_changed_after_verification_is_hashed_again_and_caught(root, tmp_path):
    d = _fresh(root, "bf16", tmp_path)
    FeatureDataset(d)
    shard = d / "shard-r000-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))  # same size, new mtime
    with pytest.raises(ValueError, match="shard-r000-00001.safetensors is corrupt"):
        FeatureDataset(d)


def test_a_rewrite_that_restores_the_mtime_is_caught_too(root, tmp_path):
    """Written in place with its size and mtime put back: the ctime moved, so `once` hashes it again."""
    d = _fresh(root, "bf16", tmp_path)
    FeatureDataset(d)
    time.sleep(0.05)  # past the filesystem's timestamp tick (the kernel's coarse clock)
    shard = d / "shard-r000-00000.safetensors"
    stat = shard.stat()
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ValueError, match="shard-r000-00000.safetensors is corrupt"):
        FeatureDataset(d)


def test_what_once_cannot_see_always_does(root, tmp_path):
    """A change below the filesystem (a disk's bit rot) leaves every stat field alone: `once` trusts the record,
    --verify-features always hashes and catches it. Simulated by recording the changed file's stat."""
    d = _fresh(root, "bf16", tmp_path)
    FeatureDataset(d)
    shard = d / "shard-r000-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    record = json.loads((d / STAMP).read_text())
    record["shards"][shard.name].update(file_stamp(shard))
    (d / STAMP).write_text(json.dumps(record))
    assert FeatureDataset(d).hashed_shards == 0
    with pytest.raises(ValueError, match="shard-r000-00000.safetensors is corrupt"):
        FeatureDataset(d, verify="shard")


def test_a_foreign_or_broken_record_means_hashing_again(root, tmp_path):
    d = _fresh(root, "bf16", tmp_path)
    (d / STAMP).write_text("not json")
    shards = len(FeatureDataset(d, verify="none").manifest["shards"])
    assert FeatureDataset(d).hashed_shards == shards
    assert FeatureDataset(d).hashed_shards == 0


@pytest.mark.parametrize("dtype, carried", [("bf16", torch.bfloat16), ("fp8", torch.float32)])
def test_batches_carry_the_storage_dtype_with_float32_values(root, dtype, carried):
    ds = FeatureDataset(root / dtype, split="all", verify="none")
    packed = PackedDataset(ds, 64, seed=None)
    rows = [packed[0], packed[1]]
    batch = PackedCollator(max_seq_len=64)(rows)
    wide = PackedCollator(max_seq_len=64, keep_storage_dtype=False)(rows)
    for key in ("aux_hidden_states", "last_hidden_state"):
        assert batch[key].dtype == carried and wide[key].dtype == torch.float32
        assert torch.equal(batch[key].float(), wide[key])
    if dtype == "bf16":
        assert batch["aux_hidden_states"].nbytes * 2 == wide["aux_hidden_states"].nbytes


def test_a_bf16_batch_trains_exactly_as_its_float32_copy(root):
    """The drafter upcasts on the device what float32 decoding did on the host: the same loss and gradients."""
    ds = FeatureDataset(root / "bf16", split="all", verify="none")
    packed = PackedDataset(ds, 64, seed=None)
    rows = [packed[0], packed[1]]
    results = []
    for keep in (True, False):
        batch = PackedCollator(max_seq_len=64, keep_storage_dtype=keep)(rows)
        model = tiny_model()
        model.attach_teacher(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.05)
        step = drafter_loss(model, batch, model.t2d, 3, 0.8)
        assert step.total is not None
        step.total.backward()
        results.append((step.total.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_workers_pinned_and_persistent_only_where_cuda_is(monkeypatch):
    assert loader_defaults(cuda=False) == {"dataloader_num_workers": 0}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    gpu = loader_defaults(cuda=True)
    assert gpu["dataloader_num_workers"] >= 1 and gpu["dataloader_pin_memory"]
    assert gpu["dataloader_persistent_workers"] and gpu["dataloader_prefetch_factor"] >= 2
