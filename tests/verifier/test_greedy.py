"""The greedy head in bf16 (the accelerator's path) gives the fp32 token except at numerical ties."""

from __future__ import annotations

import pytest
import torch

from eagle3_hf.verifier import greedy
from eagle3_hf.verifier.greedy import greedy_argmax

# positions whose fp32 top-2 logits differ by less than this are ties, excluded from the comparison
TIE_MARGIN = 1e-3


def _reference(weight: torch.Tensor, hidden: torch.Tensor, softcap: float | None = None):
    logits = hidden.float() @ weight.float().T
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    top2 = logits.topk(2, dim=-1).values
    return logits.argmax(-1), (top2[:, 0] - top2[:, 1]) >= TIE_MARGIN


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_bf16_equals_fp32_but_for_ties(monkeypatch, softcap):
    torch.manual_seed(0)
    vocab, hidden, tokens = 5000, 256, 300
    # a head stored in bf16 (as checkpoints are); states of a verifier's scale, some positions near-ties
    weight = (torch.randn(vocab, hidden) * 0.05).bfloat16()
    h = torch.randn(tokens, hidden) * 3
    h[:20] = weight[7].float() * 40 + weight[8].float() * 40  # two tokens almost equally likely
    monkeypatch.setattr(greedy, "MAX_TOKENS_PER_CHUNK", 64)  # several token and vocabulary chunks
    monkeypatch.setattr(greedy, "MIN_VOCAB_PER_CHUNK", 1024)
    monkeypatch.setattr(greedy, "LOGIT_ELEMENTS_PER_CHUNK", 64 * 1024)
    want, decided = _reference(weight, h, softcap)
    fp32 = greedy_argmax(weight.float(), h, softcap)
    bf16 = greedy_argmax(weight, h, softcap)
    assert torch.equal(fp32, want)  # the fp32 path, chunked, is the reference exactly
    assert decided.sum() >= tokens - 25
    assert torch.equal(bf16[decided], want[decided])
    # the low-precision logits alone would differ more often: the fp32 rescoring is what makes them agree
    plain = (h.bfloat16() @ weight.T).float().argmax(-1)
    assert (bf16 == want).sum() >= (plain == want).sum()


def test_empty_and_dtype_choice(monkeypatch):
    weight = torch.randn(10, 4)
    assert greedy_argmax(weight, torch.zeros(0, 4)).shape == (0,)
    monkeypatch.setattr(greedy, "cpu_has_bf16", lambda: False)
    assert greedy.head_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setattr(greedy, "cpu_has_bf16", lambda: True)
    assert greedy.head_dtype(torch.device("cpu")) == torch.bfloat16
    assert greedy.head_dtype(torch.device("cuda", 0)) == torch.bfloat16
    monkeypatch.setenv("EAGLE3_HF_HEAD_DTYPE", "bfloat16")
    assert greedy.head_dtype(torch.device("cpu")) == torch.bfloat16
    monkeypatch.setenv("EAGLE3_HF_HEAD_DTYPE", "fp8")
    with pytest.raises(ValueError, match="EAGLE3_HF_HEAD_DTYPE"):
        greedy.head_dtype(torch.device("cpu"))
