"""The TTT attention over packed rows: one call per step over the whole batch (`PackedRowKeys`), exact against the
dense per-document pattern (`_causal_with_diagonals`) in fp32, and in bf16 within bf16 tolerance — the half
precision branch of the virtual keys (hi + lo scores) included, and shown to matter: with the split turned off
a bf16 diagonal score loses the precision the test holds it to."""

from __future__ import annotations

import pytest
import torch

from eagle3_hf.model.ttt_attention import (
    PackedDocumentKeys,
    PackedRowKeys,
    _causal_with_diagonals,
    document_spans,
    packed_keys,
)

from tests.helpers.drafters import packed_batch, tiny_model

ROWS = [[7, 9, 4], [12, 1, 3, 5], [30]]  # documents per row; the rows are padded to LENGTH
LENGTH = 32


def step_tensors(attn, batch: int, length: int, steps: int, dtype=torch.float32, seed: int = 0):
    """Per step (q, k, v): q [B, nh, L, hd], k/v [B, nkv, L, hd], with scores large enough to matter."""
    g = torch.Generator().manual_seed(seed)
    shape_q = (batch, attn.num_heads, length, attn.head_dim)
    shape_kv = (batch, attn.num_key_value_heads, length, attn.head_dim)
    return [(torch.randn(shape_q, generator=g).to(dtype) * 2, torch.randn(shape_kv, generator=g).to(dtype) * 2,
             torch.randn(shape_kv, generator=g).to(dtype)) for _ in range(steps)]


def brute_force(attn, tensors, doc: torch.Tensor) -> list[torch.Tensor]:
    """Per step [B, L, nh * hd] in fp64: for each document alone, keys [k_0 | k_1 .. k_i] under the dense mask
    `_causal_with_diagonals` (the contract), softmax, values. Padding rows stay zero."""
    groups = attn.num_heads // attn.num_key_value_heads
    outs = []
    for i in range(len(tensors)):
        q = tensors[i][0].double()
        out = torch.zeros(q.shape[0], q.shape[2], q.shape[1] * q.shape[3], dtype=torch.float64)
        for b, spans in enumerate(document_spans(doc)):
            for start, end in spans:
                n = end - start
                keys = torch.cat([tensors[j][1][b, :, start:end].double() for j in range(i + 1)], dim=1)
                values = torch.cat([tensors[j][2][b, :, start:end].double() for j in range(i + 1)], dim=1)
                keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
                scores = q[b, :, start:end] @ keys.transpose(1, 2) * attn.scaling  # [nh, n, (i+1) n]
                scores = scores + _causal_with_diagonals(n, i + 1, torch.float64, "cpu")
                o = torch.softmax(scores, dim=-1) @ values  # [nh, n, hd]
                out[b, start:end] = o.transpose(0, 1).reshape(n, -1)
        outs.append(out)
    return outs


def unroll(attn, keys, tensors) -> list[torch.Tensor]:
    return [keys.attend(attn, q, k, v) for q, k, v in tensors]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("steps", [1, 2, 3, 5, 7])
def test_row_attention_equals_dense_per_document_reference(impl, steps):
    model = tiny_model()
    attn = model.midlayer.self_attn
    attn.config._attn_implementation = impl
    assert attn.num_heads > attn.num_key_value_heads  # GQA
    _, _, _, doc = packed_batch(ROWS, LENGTH)
    tensors = step_tensors(attn, len(ROWS), LENGTH, steps)
    valid = (doc != -1)[..., None]
    got = unroll(attn, PackedRowKeys(doc, steps), tensors)
    per_document = unroll(attn, PackedDocumentKeys(document_spans(doc)), tensors)
    for i, (row, ref, docs) in enumerate(zip(got, brute_force(attn, tensors, doc), per_document)):
        assert torch.isfinite(row).all()  # padding rows too: never read, but a NaN would poison the backward
        torch.testing.assert_close((row * valid).double(), ref, atol=1e-5, rtol=1e-5, msg=f"step {i}")
        torch.testing.assert_close(row * valid, docs, atol=1e-5, rtol=1e-5)  # the CPU path agrees


def test_packed_keys_choose_the_path_explicitly():
    doc = torch.zeros(1, 4, dtype=torch.long)
    assert isinstance(packed_keys(doc, 3, "row"), PackedRowKeys)
    assert isinstance(packed_keys(doc, 3, "document"), PackedDocumentKeys)
    assert isinstance(packed_keys(doc, 3, "auto"), PackedDocumentKeys)  # on the CPU
    with pytest.raises(ValueError, match="'auto', 'row' or 'document'"):
        packed_keys(doc, 3, "dense")


@pytest.mark.parametrize("autocast", [False, True])
def test_row_attention_in_bf16_is_within_bf16_tolerance(autocast):
    """bf16 q/k/v (the hi + lo branch: the diagonal scores keep fp32 precision), and fp32 q/k under bf16
    autocast as RoPE leaves them (the branch runs too: autocast casts the kernel's inputs)."""
    model = tiny_model()
    attn = model.midlayer.self_attn
    steps = 4
    _, _, _, doc = packed_batch(ROWS, LENGTH)
    tensors = step_tensors(attn, len(ROWS), LENGTH, steps)
    valid = (doc != -1)[..., None]
    reference = brute_force(attn, tensors, doc)
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = unroll(attn, PackedRowKeys(doc, steps), tensors)
    else:
        half = [tuple(t.bfloat16() for t in step) for step in tensors]
        got = unroll(attn, PackedRowKeys(doc, steps), half)
    for row, ref in zip(got, reference):
        assert row.dtype == torch.bfloat16 or autocast  # CPU autocast leaves sdpa in fp32 (CUDA's casts it)
        # bf16 keeps 8 bits: inputs rounded to 2^-9 relative, scores of size ~10 -> weights within a few %
        err = ((row.double() - ref) * valid).abs()
        assert err.max() < 0.08 and err.mean() < 0.01, (err.max(), err.mean())


def rounded_scores(scores: torch.Tensor, kernel: torch.dtype) -> tuple[torch.Tensor, int]:
    """The diagonal scores without the hi + lo split: rounded to the kernel's half dtype, one dim per slot."""
    return (scores if kernel in (torch.float32, torch.float64) else scores.to(kernel)), 1


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("split", [True, False])
def test_bf16_diagonal_scores_keep_fp32_precision_through_the_hi_lo_split(autocast, split, monkeypatch):
    """A query whose diagonal key equals its own step-0 key must weigh the two alike. With scores of a few hundred
    (raw q . k) a bf16-rounded diagonal score is off by up to 1 (0.25 after scaling): the two weights split about
    44/56 instead of 50/50. Inputs exactly representable in bf16, so the kernel's own rounding is lossless and
    the reference (fp64 of the same values) is what an exact kernel returns: the hi + lo pair must match it to
    the output's bf16 rounding; without the split (`split=False`) the same check fails."""
    import eagle3_hf.model.ttt_attention as ttt

    if not split:
        monkeypatch.setattr(ttt, "score_slots", rounded_scores)
    model = tiny_model()
    attn = model.midlayer.self_attn
    _, _, _, doc = packed_batch(ROWS, LENGTH)
    valid = (doc != -1)[..., None]
    (q0, k0, v0), (_, _, v1) = step_tensors(attn, len(ROWS), LENGTH, 2)
    q1 = 4 * k0.repeat_interleave(attn.num_heads // attn.num_key_value_heads, 1)  # raw self scores ~4 |k|^2 ~ 256
    tensors = [tuple(t.bfloat16().float() for t in step) for step in [(q0, k0, v0), (q1, k0.clone(), v1)]]
    reference = brute_force(attn, tensors, doc)[1]
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = unroll(attn, PackedRowKeys(doc, 2), tensors)[1]
    else:
        got = unroll(attn, PackedRowKeys(doc, 2), [tuple(t.bfloat16() for t in step) for step in tensors])[1]
    err = ((got.double() - reference) * valid).abs()
    within = bool(err.max() < 0.02 and err.mean() < 0.002)  # measured with the split: max 0.008, mean 0.0006
    assert within == split, (err.max(), err.mean())  # without it: max 0.23, mean 0.019


@pytest.mark.slow
def test_flex_attention_block_mask_equals_the_reference():
    """flex_attention gets a BlockMask from document_ids (blocks of other documents skipped); its forward runs on
    the CPU (compiled: ~30 s here), its backward only on a GPU (gpu_check times it there)."""
    model = tiny_model()
    attn = model.midlayer.self_attn
    attn.config._attn_implementation = "flex_attention"
    _, _, _, doc = packed_batch(ROWS, LENGTH)
    tensors = step_tensors(attn, len(ROWS), LENGTH, 3)
    valid = (doc != -1)[..., None]
    with torch.no_grad():
        got = unroll(attn, PackedRowKeys(doc, 3), tensors)
    for row, ref in zip(got, brute_force(attn, tensors, doc)):
        torch.testing.assert_close((row * valid).double(), ref, atol=1e-5, rtol=1e-5)
