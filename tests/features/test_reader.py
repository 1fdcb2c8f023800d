"""Reading features: corruption is caught and named, the split is stable, packing never mixes documents or
loses a token, and online batches equal offline ones."""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from eagle3_hf.data.prepared_samples import PreparedDataset, in_validation, select_split
from eagle3_hf.features.collator import FeatureCollator
from eagle3_hf.features.packing import PackedCollator, PackedDataset, _first_fit_decreasing
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.routes.transformers import TransformersFeatures, extract_features
from eagle3_hf.features.write import StoreOptions

from tests.helpers.data import make_prepared
from tests.helpers.verifiers import make_tiny_verifier


@pytest.fixture(scope="module")
def verifier():
    return make_tiny_verifier(vocab_size=2048, hidden_size=32, num_layers=6)


@pytest.fixture(scope="module")
def features(tmp_path_factory, verifier, fingerprint):
    root = tmp_path_factory.mktemp("feat")
    prepared = make_prepared(root / "prep", fingerprint, n=14, lo=3, hi=30, vocab=2048)
    extract_features(verifier, fingerprint, prepared, root / "f32", dtype="float32", store=StoreOptions(4),
                     progress=False)
    return root


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_corrupt_shard_named(features, tmp_path):
    d = _copy(features / "f32", tmp_path / "c")
    shard = d / "shard-r000-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="shard-r000-00001.safetensors is corrupt"):
        FeatureDataset(d)
    FeatureDataset(d, verify="none")  # sizes still fine: only the checksum can tell
    ds = FeatureDataset(d, split="all", verify="sample")
    bad = [i for i, s in enumerate(ds.manifest["samples"]) if s["shard"] == shard.name][-1]
    with pytest.raises(ValueError, match=f"sample '{ds.sample_ids[bad]}' .*corrupt"):
        ds[bad]


def test_truncated_or_missing_shard_named(features, tmp_path):
    d = _copy(features / "f32", tmp_path / "t")
    shard = d / "shard-r000-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match="shard-r000-00002.safetensors is .* bytes.*truncated"):
        FeatureDataset(d, verify="none")
    shard.unlink()
    with pytest.raises(FileNotFoundError, match="shard-r000-00002.safetensors"):
        FeatureDataset(d, verify="none")


def test_reads_are_views_of_the_mapped_file(features):
    ds = FeatureDataset(features / "f32", split="all")
    raw = ds.raw(3)
    mm = ds._open[ds.manifest["samples"][3]["shard"]]
    base = mm.ctypes.data
    for t in raw.values():
        assert base <= t.data_ptr() < base + mm.nbytes  # no copy out of the map
    assert ds.get(3, 2, 5)["input_ids"].shape == (3,)
    assert torch.equal(ds.get(3, 2, 5)["aux_hidden_states"], ds[3]["aux_hidden_states"][2:5])
    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers
    assert torch.equal(clone[5]["last_hidden_state"], ds[5]["last_hidden_state"])


def test_split_deterministic_and_disjoint(features):
    ids = [f"sample-{i}" for i in range(2000)]
    val = select_split(ids, "validation", 0.1)
    shuffled = ids[:]
    random.Random(1).shuffle(shuffled)
    assert sorted(ids[i] for i in val) == sorted(shuffled[i] for i in select_split(shuffled, "validation", 0.1))
    assert 150 < len(val) < 250
    train = select_split(ids, "train", 0.1)
    assert sorted(train + val) == list(range(2000))
    # pinned: the split must not change across processes, machines or releases (a salted hash() or another
    # digest would move samples between train and validation and leak validation into training)
    assert [i for i in range(60) if in_validation(f"sample-{i}", 0.1)] == [1, 19, 25, 26, 32, 39, 54, 55]
    at_03 = {i for i in range(60) if in_validation(f"sample-{i}", 0.3)}
    assert {1, 19, 25, 26, 32, 39, 54, 55} < at_03 and len(at_03) == 22  # a larger fraction only adds samples
    assert not any(in_validation(f"sample-{i}", 0.0) for i in range(200))
    assert all(in_validation(f"sample-{i}", 1.0) for i in range(200))
    tr = FeatureDataset(features / "f32", split="train", validation_fraction=0.3)
    va = FeatureDataset(features / "f32", split="validation", validation_fraction=0.3)
    assert sorted(tr.sample_ids + va.sample_ids) == FeatureDataset(features / "f32", split="all").sample_ids
    assert len(va) > 0 and len(tr) > 0


class _Toy:
    """Samples whose every token is (sample index, position): loss of mixing is visible."""

    def __init__(self, lengths):
        self.lengths = lengths
        self.sample_ids = [f"t{i}" for i in range(len(lengths))]

    def __getitem__(self, i):
        n = self.lengths[i]
        pos = torch.arange(n)
        return {"input_ids": i * 1000 + pos, "loss_mask": pos % 2 == 0, "verifier_greedy": pos,
                "aux_hidden_states": torch.full((n, 6), float(i)),
                "last_hidden_state": pos[:, None].float().expand(n, 2),
                "sample_id": self.sample_ids[i]}


@pytest.mark.parametrize("packing,overlong", [(True, "split"), (True, "truncate"), (False, "split")])
def test_packing_never_mixes_and_loses_nothing(packing, overlong):
    rng = random.Random(0)
    lengths = [rng.randint(0, 70) for _ in range(60)]
    L = 64
    packed = PackedDataset(_Toy(lengths), L, packing=packing, overlong=overlong, seed=3)
    batch = PackedCollator(pad_token_id=0)([packed[r] for r in range(len(packed))])
    assert batch["input_ids"].shape == (len(packed), L) and batch["aux_hidden_states"].shape == (len(packed), L, 6)
    seen: dict[int, list[int]] = {}
    for b in range(len(packed)):
        docs = batch["document_ids"][b]
        n = int((docs >= 0).sum())
        assert (docs[:n] >= 0).all() and (docs[n:] == -1).all() and not batch["loss_mask"][b, n:].any()
        for d in docs[:n].unique().tolist():
            sel = docs == d
            tok = batch["input_ids"][b][sel]
            sample = int(tok[0]) // 1000
            assert (tok // 1000 == sample).all()  # one document = one sample
            assert (batch["aux_hidden_states"][b][sel] == sample).all()
            assert torch.equal(batch["position_ids"][b][sel], torch.arange(int(sel.sum())))  # restarts at 0
            seen.setdefault(sample, []).extend((tok % 1000).tolist())
    for i, n in enumerate(lengths):
        want = list(range(min(n, L))) if overlong == "truncate" else list(range(n))
        assert sorted(seen.get(i, [])) == want, i  # every token exactly once
    st = packed.stats
    assert st["empty"] == lengths.count(0)
    over = sum(n > L for n in lengths)
    assert st["split" if overlong == "split" else "truncated"] == over
    if overlong == "truncate":
        assert st["truncated_tokens"] == sum(n - L for n in lengths if n > L)
    if packing:
        assert len(packed) < sum(n > 0 for n in lengths) and st["fill"] > 0.8


def test_packing_plan_deterministic_and_overlong_error():
    lengths = [random.Random(5).randint(1, 100) for _ in range(300)]
    a = PackedDataset(_Toy(lengths), 128, seed=7).rows
    assert a == PackedDataset(_Toy(lengths), 128, seed=7).rows
    assert a != PackedDataset(_Toy(lengths), 128, seed=8).rows
    bins = _first_fit_decreasing([5, 9, 3, 7, 1], 10)
    assert bins == [[1, 4], [3, 2], [0]]  # 9+1, 7+3, 5
    with pytest.raises(ValueError, match="sample 't1' has 300 tokens > max_seq_len 128"):
        PackedDataset(_Toy([5, 300]), 128, overlong="error")


def test_online_equals_offline(features, verifier, fingerprint):
    """The verifier in the training process (FeatureCollator over TransformersFeatures) gives offline's batch bit
    for bit, split pieces included: each sample runs whole, as extraction ran it, and is sliced after."""
    offline = PackedDataset(FeatureDataset(features / "f32", split="all"), 24, overlong="split", seed=1)
    every = PreparedDataset(features / "prep", split="all", tokenizer_fingerprint=fingerprint)
    online = PackedDataset(every, 24, overlong="split", seed=1)
    assert offline.rows == online.rows and offline.stats["split"] > 0
    rows = list(range(len(offline)))
    off = PackedCollator()([offline[r] for r in rows])
    source = TransformersFeatures(verifier, fingerprint, (2, 4, 5), "float32")
    on = FeatureCollator(source, every, max_seq_len=24)([online[r] for r in rows])
    assert off.keys() == on.keys()
    for key in off:
        assert off[key].dtype == on[key].dtype and torch.equal(off[key], on[key]), key
    rounded = FeatureCollator(source, every, storage_dtype="bf16", max_seq_len=24)([online[0]])
    assert rounded["aux_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(rounded["aux_hidden_states"], off["aux_hidden_states"][:1].bfloat16())


def test_max_tokens_takes_nested_stratified_subsets_and_leaves_validation_alone(features):
    from eagle3_hf.data.subsets import token_subset

    full = FeatureDataset(features / "f32", split="train", validation_fraction=0.3)
    order = token_subset(full.sample_ids, full.lengths, sum(full.lengths))
    assert order == list(range(len(full)))  # the whole budget keeps every sample
    budget = sum(full.lengths) // 2
    small = FeatureDataset(features / "f32", split="train", validation_fraction=0.3, max_tokens=budget)
    smaller = FeatureDataset(features / "f32", split="train", validation_fraction=0.3, max_tokens=budget // 2)
    want = [full.sample_ids[i] for i in token_subset(full.sample_ids, full.lengths, budget)]
    assert small.sample_ids == want and 0 < sum(small.lengths) <= budget
    assert set(smaller.sample_ids) < set(small.sample_ids) < set(full.sample_ids)
    val = FeatureDataset(features / "f32", split="validation", validation_fraction=0.3)
    assert val.sample_ids == FeatureDataset(features / "f32", split="validation", validation_fraction=0.3,
                                            max_tokens=budget).sample_ids  # validation unchanged
    assert not set(val.sample_ids) & set(small.sample_ids)


def test_splits_selected_from_one_open_directory_equal_the_splits_opened_alone(features, fingerprint):
    """Training opens a feature or prepared directory once and selects its splits from it: the same samples, in the
    same order, as a directory opened for each split, and a feature directory's split is its prepared samples'."""
    shards = FeatureDataset(features / "f32", split="all", verify="none")
    every = PreparedDataset(features / "prep", split="all", tokenizer_fingerprint=fingerprint)
    budget = sum(shards.lengths) // 3
    for split, max_tokens in (("train", budget), ("train", None), ("validation", None)):
        alone = FeatureDataset(features / "f32", split=split, validation_fraction=0.3, max_tokens=max_tokens)
        part = shards.select(split, 0.3, max_tokens=max_tokens)
        assert (part.sample_ids, part.lengths, part.split) == (alone.sample_ids, alone.lengths, split)
        assert torch.equal(part[0]["aux_hidden_states"], alone[0]["aux_hidden_states"])
        rows = every.select(split, 0.3)
        assert rows.sample_ids == PreparedDataset(features / "prep", split, 0.3, fingerprint).sample_ids
        if max_tokens is None:
            assert (rows.sample_ids, rows.lengths) == (part.sample_ids, part.lengths)
            assert torch.equal(rows[0]["input_ids"], part[0]["input_ids"])
            assert rows.position(rows.sample_ids[-1]) == len(rows) - 1
    assert len(shards) == len(every) == 14  # selecting leaves the opened directory whole
