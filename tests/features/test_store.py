"""The shard format: fp8 round-trip bounded and half the bytes, journals survive torn writes, headers guard."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf.features.quantize import dequantize, quantize
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.records import canonical_dtype, make_header
from eagle3_hf.features.shard_writer import ShardWriter
from eagle3_hf.features.store import check_header, merge_manifests, read_journal

from tests.helpers.data import feature_files

H = 48


def _header(dtype="bfloat16", **kw):
    verifier = {"name": "tiny", "revision": None, "num_hidden_layers": 6, "hidden_size": H, "vocab_size": 100}
    verifier.update(kw)
    return make_header(verifier, "fp", (1, 3, 5), dtype)


def _sample(t, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 2, t)[:, None]  # rows with very different magnitudes
    return (torch.randint(0, 100, (t,), generator=g), torch.ones(t, dtype=torch.bool),
            torch.randn(t, 3 * H, generator=g) * scale, torch.randn(t, H, generator=g) * scale,
            torch.randint(0, 100, (t,), generator=g))


def _write(out, dtype, n=6, t=20, per_shard=3):
    w = ShardWriter(out, _header(dtype), samples_per_shard=per_shard)
    for i in range(n):
        w.add(f"x{i}", *_sample(t, i))
    w.close()
    merge_manifests(out)
    return out


def test_dtype_names():
    assert canonical_dtype("bf16") == "bfloat16" and canonical_dtype("fp8") == "float8_e4m3fn"
    with pytest.raises(ValueError, match="unknown feature dtype"):
        canonical_dtype("int4")


def test_fp8_roundtrip_bounded():
    x = torch.randn(50, 3 * H) * torch.logspace(-3, 3, 50)[:, None]
    q, scale = quantize(x, 3, "fp8")
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (50, 3)
    y = dequantize(q, scale)
    # e4m3 keeps 3 mantissa bits: error <= 2^-4 of the value, and at most 2^-4 * amax of its row near zero
    rowmax = x.reshape(50, 3, H).abs().amax(-1, keepdim=True).expand(50, 3, H).reshape(50, -1)
    assert ((y - x).abs() <= torch.maximum(x.abs(), rowmax / 64) / 16 + 1e-12).all()
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
    assert cos.min() > 0.998


def test_fp8_halves_bytes_and_reads_back(tmp_path):
    bf, f8 = _write(tmp_path / "bf16", "bf16"), _write(tmp_path / "fp8", "fp8")
    size = lambda d: sum(s["bytes"] for s in json.loads((d / "manifest.json").read_text())["shards"])  # noqa: E731
    ratio = size(f8) / size(bf)
    assert 0.45 < ratio < 0.6, ratio
    a, b = FeatureDataset(bf, split="all"), FeatureDataset(f8, split="all")
    for i in range(6):
        _, _, aux, last, greedy = _sample(20, i)
        assert torch.equal(b[i]["verifier_greedy"], greedy)
        rel = (b[i]["aux_hidden_states"] - aux).norm(dim=-1) / aux.norm(dim=-1)
        assert rel.max() < 0.05
        assert torch.allclose(a[i]["last_hidden_state"], last, rtol=1e-2)


def test_nan_counted_not_written(tmp_path):
    w = ShardWriter(tmp_path, _header())
    ids, mask, aux, last, greedy = _sample(5, 0)
    aux[2, 7] = float("inf")
    assert w.add("bad", ids, mask, aux, last, greedy) is False
    assert w.add("good", *_sample(5, 1)) is True
    w.close()
    m = merge_manifests(tmp_path)
    assert [s["id"] for s in m["samples"]] == ["good"] and m["skipped"] == {"nan_or_inf": 1}


def test_torn_journal_line_is_ignored_and_repaired(tmp_path):
    out = _write(tmp_path / "f", "bf16", n=6, per_shard=2)
    journal = out / "manifest.r000.jsonl"
    text = journal.read_text()
    journal.write_text(text + '{"shard": {"file": "shard-r000-0')  # killed mid-append
    header, records = read_journal(journal)
    assert header["dtype"] == "bfloat16" and len(records) == 3
    w = ShardWriter(out, _header(), samples_per_shard=2)  # opening for rank 0 cuts the torn tail
    assert journal.read_text() == text and w.next_idx == 3 and w.done_ids == {f"x{i}" for i in range(6)}
    w.close()


def test_header_mismatch_names_field(tmp_path):
    _write(tmp_path, "bf16", n=2)
    with pytest.raises(ValueError, match="verifier=.*hidden_size"):
        ShardWriter(tmp_path, _header(hidden_size=64))
    with pytest.raises(ValueError, match="dtype"):
        check_header(_header(), _header("fp8"), "here")


def test_fp8_table_decode_and_collate(tmp_path):
    from eagle3_hf.features.packing import PackedCollator, PackedDataset
    from eagle3_hf.features.quantize import fp8_to_float32

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    ref, got = codes.float(), fp8_to_float32(codes)
    assert torch.equal(ref.isnan(), got.isnan()) and torch.equal(ref[~ref.isnan()], got[~got.isnan()])
    ds = FeatureDataset(_write(tmp_path / "fp8", "fp8", n=5, t=20), split="all")
    packed = PackedDataset(ds, 64, seed=None)
    batch = PackedCollator()([packed[r] for r in range(len(packed))])
    for b, row in enumerate(packed.rows):  # decoding in the collator == decoding in __getitem__
        at = 0
        for i, s, e in row:
            assert torch.equal(batch["aux_hidden_states"][b, at:at + e - s], ds[i]["aux_hidden_states"][s:e])
            assert torch.equal(batch["last_hidden_state"][b, at:at + e - s], ds[i]["last_hidden_state"][s:e])
            at += e - s
        assert (batch["aux_hidden_states"][b, at:] == 0).all()


# ---------------------------------------------------------------- an unfinished extraction is refused unless asked for

def test_journals_without_a_manifest_are_refused_unless_partial_is_allowed(tmp_path, capsys):
    from eagle3_hf.features.store import PartialFeaturesError, load_manifest

    out = tmp_path / "f"
    w = ShardWriter(out, _header("float32"), samples_per_shard=2)
    for i in range(5):
        w.add(f"x{i}", *_sample(8, i))
    w.close()  # killed before the merge: journals only
    with pytest.raises(PartialFeaturesError) as err:
        FeatureDataset(out, split="all")
    assert str(err.value) == (f"{out}: an unfinished extraction (no manifest.json; its journals hold 5 samples): "
                              "rerun the extract command to finish it, or pass --allow-partial-features to use "
                              "what is there")
    assert len(FeatureDataset(out, split="all", allow_partial=True)) == 5
    assert capsys.readouterr().err.strip() == (f"[features] warning: {out}: an unfinished extraction (no "
                                               "manifest.json; its journals hold 5 samples): using 5 samples "
                                               "(--allow-partial-features)")
    merge_manifests(out)
    assert len(load_manifest(out)["samples"]) == 5


def test_a_merge_that_stopped_waiting_says_n_of_m_and_a_resumed_writer_unmerges(tmp_path, capsys):
    from eagle3_hf.features.store import PartialFeaturesError, load_manifest, wait_and_merge

    out = tmp_path / "f"
    w = ShardWriter(out, _header("float32"), samples_per_shard=2)
    for i in range(3):
        w.add(f"x{i}", *_sample(8, i))
    w.close()
    wait_and_merge(out, [f"x{i}" for i in range(5)], timeout_s=0)  # ranks that never came: 2 missing
    with pytest.raises(PartialFeaturesError, match=r"its manifest lists 3 of 5 samples, 2 not yet extracted"):
        load_manifest(out)
    assert len(load_manifest(out, allow_partial=True)["samples"]) == 3
    w = ShardWriter(out, _header("float32"), samples_per_shard=2)  # the rerun resumes: not refused
    assert w.done_ids == {"x0", "x1", "x2"}
    w.add("x3", *_sample(8, 3))
    w.flush()
    w.wait()  # one more shard committed: the old manifest no longer lists everything and is gone
    assert not (out / "manifest.json").exists()
    with pytest.raises(PartialFeaturesError, match="its journals hold 4 samples"):
        load_manifest(out)
    w.add("x4", *_sample(8, 4))
    w.close()
    assert len(wait_and_merge(out, [f"x{i}" for i in range(5)], timeout_s=0)["samples"]) == 5
    assert "missing_samples" not in load_manifest(out)
    capsys.readouterr()


def test_several_writers_write_the_same_bytes_and_journal_in_order(tmp_path):
    one, three = _write(tmp_path / "one", "bf16", n=7, per_shard=1), tmp_path / "three"
    w = ShardWriter(three, _header("bf16"), samples_per_shard=1, writers=3)
    for i in range(7):
        w.add(f"x{i}", *_sample(20, i))
    w.close()
    merge_manifests(three)
    assert feature_files(one) == feature_files(three)


def test_a_failed_commit_among_several_journals_nothing_after_it_and_the_rerun_completes(tmp_path, monkeypatch):
    """Shard 2's write fails while 3 and 4 are written beside it: the journal keeps 0 and 1 only (no gap), the
    files of 3 and 4 are removed at the restart, which writes the rest."""
    import errno
    import time

    from eagle3_hf.features import shard_writer

    real = shard_writer.atomic_write_bytes

    def flaky(path, data):
        if path.name.endswith("00001.safetensors"):
            time.sleep(0.3)  # 2, 3 and 4 are in flight meanwhile
        if path.name.endswith("00002.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(shard_writer, "atomic_write_bytes", flaky)
    w = ShardWriter(tmp_path, _header("bf16"), samples_per_shard=1, writers=3)
    with pytest.raises(OSError, match=r"shard-r000-00002.safetensors; the shards before it are complete"):
        for i in range(6):
            w.add(f"x{i}", *_sample(20, i))
        w.close()
    w._pool.shutdown(wait=True)
    _header_line, records = read_journal(tmp_path / "manifest.r000.jsonl")
    assert [r["shard"]["file"] for r in records] == ["shard-r000-00000.safetensors", "shard-r000-00001.safetensors"]
    monkeypatch.setattr(shard_writer, "atomic_write_bytes", real)
    again = ShardWriter(tmp_path, _header("bf16"), samples_per_shard=1, writers=3)
    assert again.next_idx == 2 and again.done_ids == {"x0", "x1"}
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == ["shard-r000-00000.safetensors",
                                                                 "shard-r000-00001.safetensors"]
    for i in range(2, 6):
        again.add(f"x{i}", *_sample(20, i))
    again.close()
    merge_manifests(tmp_path)
    ds = FeatureDataset(tmp_path, split="all", verify="sample")
    assert sorted(ds.sample_ids) == [f"x{i}" for i in range(6)]
