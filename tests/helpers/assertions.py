"""Assertions the tests share: a speculative decoder's output equals plain greedy decoding, a chi-square test of
sampled counts against exact probabilities, and two training runs that took the same steps."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3_hf.decoding import compare_to_greedy, greedy_generate


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's test of observed counts against exact probabilities; sparse cells pooled into one."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].sum().double().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def assert_matches_greedy(verifier, prompt, max_new_tokens, spec, **greedy_kwargs):
    """`spec` (a speculative decoder's output, chain or tree) equals plain greedy decoding of `prompt`."""
    reference = greedy_generate(verifier, prompt, max_new_tokens, **greedy_kwargs)
    assert compare_to_greedy(spec.tokens, spec.margins, reference.tokens, reference.margins) == ("match", None)
    # stronger than tokens: the verifier computed the same distribution at every position (caches right)
    torch.testing.assert_close(torch.tensor(spec.margins), torch.tensor(reference.margins), atol=1e-4, rtol=1e-4)
    assert len(spec.tokens) - 1 == sum(spec.accepted_per_step) + spec.num_verifier_forwards
    return spec


def assert_same_training(off: Path, on: Path, steps: int) -> None:
    """Two runs' `--output-dir`s logged `steps` equal losses and saved equal weights, bit for bit."""
    losses = {}
    for run in (off, on):
        summary = json.loads((run / "eagle3_training.json").read_text())
        losses[run.name] = [h["loss"] for h in summary["log_history"] if "loss" in h]
    assert len(losses[off.name]) == steps and losses[on.name] == losses[off.name], losses
    a, b = load_file(off / "model.safetensors"), load_file(on / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
