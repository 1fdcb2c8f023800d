"""Draft vocabulary: top-N assistant tokens, offsets that round-trip, refusal of foreign mappings."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eagle3_hf import cli
from eagle3_hf.data.prepare import build_meta, new_stats, prepare_conversations
from eagle3_hf.data.prepared_format import load_prepared, save_prepared
from eagle3_hf.data.vocab import (
    build_vocab,
    load_vocab,
    save_vocab,
    select_top_ids,
    token_counts,
    vocab_from_target_ids,
)
from eagle3_hf.model.checkpoint import draft_to_target

FEATURES = datasets.Features({"id": datasets.Value("string"), "input_ids": datasets.List(datasets.Value("int32")),
                              "loss_mask": datasets.List(datasets.Value("int8"))})


def _ds(rows):
    return datasets.Dataset.from_dict({"id": [str(i) for i in range(len(rows))],
                                       "input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows]},
                                      features=FEATURES)


def test_offsets_round_trip():
    kept = [3, 7, 8, 20, 99]
    d2t, t2d = vocab_from_target_ids([20, 3, 99, 8, 7], vocab_size=100)  # order of input does not matter
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (100,)
    assert d2t.tolist() == [3 - 0, 7 - 1, 8 - 2, 20 - 3, 99 - 4]
    target = draft_to_target(d2t)
    assert target.tolist() == kept and bool(t2d[target].all()) and int(t2d.sum()) == 5
    with pytest.raises(ValueError, match="0..99"):
        vocab_from_target_ids([100], 100)


def test_counts_only_assistant_tokens_ties_and_fill():
    ds = _ds([([5, 6, 6, 9, 9, 9], [0, 1, 1, 1, 1, 0]),  # assistant: 6, 6, 9, 9
              ([1, 2, 4, 2], [1, 1, 1, 0])])            # assistant: 1, 2, 4
    counts = token_counts(ds, 12)
    assert counts.tolist() == [0, 1, 1, 0, 1, 0, 2, 0, 0, 2, 0, 0]
    kept, fillers = select_top_ids(counts, 3)
    assert kept.tolist() == [1, 6, 9] and fillers == 0  # 6 and 9 (2 each), then the lowest of the tied 1, 2, 4
    kept, fillers = select_top_ids(counts, 7)  # only 5 distinct: fill with the lowest unseen ids 0 and 3
    assert kept.tolist() == [0, 1, 2, 3, 4, 6, 9] and fillers == 2
    d2t, t2d, cov, _ = build_vocab(ds, 12, 3)
    assert cov == pytest.approx(5 / 7)  # tokens 6, 6, 9, 9, 1 of the 7 assistant tokens are kept
    assert draft_to_target(d2t).tolist() == [1, 6, 9]
    with pytest.raises(ValueError, match="outside vocab_size 8"):
        token_counts(ds, 8)


def test_save_load_and_refusals(tmp_path):
    d2t, t2d = vocab_from_target_ids([0, 5, 6], 10)
    path = save_vocab(tmp_path / "v.safetensors", d2t, t2d, fingerprint="abc", coverage=0.5)
    d2t2, t2d2, meta = load_vocab(path, expect_fingerprint="abc", expect_vocab_size=10)
    assert torch.equal(d2t, d2t2) and torch.equal(t2d, t2d2)
    assert meta == {"tokenizer_fingerprint": "abc", "vocab_size": "10", "draft_vocab_size": "3", "coverage": "0.500000"}
    with pytest.raises(ValueError, match=r"v\.safetensors: built for tokenizer fingerprint 'abc', expected 'xyz'"):
        load_vocab(path, expect_fingerprint="xyz")
    with pytest.raises(ValueError, match=r"v\.safetensors: built for vocab size 10, expected 49152"):
        load_vocab(path, expect_vocab_size=49152)
    bad = tmp_path / "bad.safetensors"
    t2d_bad = t2d.clone()
    t2d_bad[5], t2d_bad[7] = False, True  # same count, different ids
    save_file({"d2t": d2t, "t2d": t2d_bad}, str(bad), metadata={"tokenizer_fingerprint": "abc", "vocab_size": "10"})
    with pytest.raises(ValueError, match=r"bad\.safetensors: d2t and t2d disagree"):
        load_vocab(bad, expect_fingerprint="abc")
    save_file({"d2t": d2t, "t2d": torch.ones(10, dtype=torch.bool)}, str(bad))
    with pytest.raises(ValueError, match="t2d marks 10 ids, d2t maps to 3"):
        load_vocab(bad)


def test_cli_vocab_on_prepared_data(tmp_path, tokenizer):
    from eagle3_hf.data.fingerprint import tokenizer_fingerprint

    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Say {w}"},
                                          {"role": "assistant", "content": f"{w} {w} {w}!"}]}
             for i, w in enumerate(["apple", "banana", "cherry"])]
    stats = new_stats()
    ds = prepare_conversations(convs, tokenizer, stats=stats)
    save_prepared(ds, tmp_path / "data", build_meta(tokenizer, "smollm2-135m-instruct", stats, {}))
    assert cli.main(["vocab", "--data", str(tmp_path / "data"), "--draft-vocab-size", "64"]) == 0
    fp = tokenizer_fingerprint(tokenizer)
    d2t, t2d, meta = load_vocab(tmp_path / "data" / "vocab.safetensors", expect_fingerprint=fp,
                                expect_vocab_size=len(tokenizer))
    ds, _ = load_prepared(tmp_path / "data")
    assistant = {t for ids, m in zip(ds["input_ids"], ds["loss_mask"]) for t, k in zip(ids, m) if k}
    assert len(assistant) < 64 and all(t2d[t] for t in assistant)  # every assistant token is covered
    assert float(meta["coverage"]) == 1.0 and meta["draft_vocab_size"] == "64"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in draft_to_target(d2t).tolist()
    assert np.all(np.diff(draft_to_target(d2t).numpy()) > 0)
