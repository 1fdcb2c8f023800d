"""A drafter built and saved by speculators 0.9.0 itself, with each option that changes its layer
(`norm_before_residual`, and EAGLE 3.1's `norm_before_fc`, `fc_norm`, `norm_output`), is read here with the
logits its own forward computes, at every TTT step.

speculators lives in its own venv: `make speculators` builds it once outside the clone (cached like vLLM's, speculators
0.9.0 over the CPU torch) and `make test` runs this test in it (EAGLE3_HF_SPECULATORS_VENV), failing when it is
missing there; run by hand without that variable, the test reads `.bench-venv/speculators` (`python -m
bench.train_step --setup-speculators`) and is skipped, saying so, where it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_hf import Eagle3DraftModel

from bench.train_step import REPO, SPEC_PYTHON, speculators_available
from tests.helpers.drafters import AUX, DRAFT_VOCAB, HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, packed_batch, vocab_mapping

VARIANTS = {
    "eagle30": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "speculators_31": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True},
}
LENGTHS, ROW, TTT = [9, 7], 16, 3


def their_row(ids, aux, pos, doc, lengths):
    """Our packed row -> speculators' (its `shift_batch` per document, then packed): its position j of a
    document holds feature j and token j + 1, which is our position j; each document loses its last position."""
    keep = torch.ones(ids.shape[1], dtype=torch.bool)
    keep[torch.cumsum(torch.tensor(lengths), 0) - 1] = False  # the feature of a document's last token
    nxt = torch.roll(ids[0], -1)
    return {"input_ids": nxt[keep][None], "hidden_states": aux[0][keep][None], "position_ids": (pos[0] + 1)[keep][None],
            "document_ids": doc[0][keep][None]}


@pytest.mark.slow
def test_speculators_drafters_read_with_their_per_step_logits(tmp_path):
    why_not = speculators_available()
    if why_not and os.environ.get("EAGLE3_HF_SPECULATORS_VENV"):
        pytest.fail(why_not)  # `make test` built it (make speculators): missing there is a failure, not a skip
    if why_not:
        pytest.skip(why_not)
    ids, aux, pos, doc = packed_batch([LENGTHS], ROW, seed=3)
    d2t, t2d = vocab_mapping()
    save_file({**their_row(ids, aux, pos, doc, LENGTHS), "d2t": d2t, "t2d": t2d}, str(tmp_path / "row.safetensors"))
    (tmp_path / "shapes.json").write_text(json.dumps({
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": INTER, "num_heads": HEADS,
        "num_kv_heads": KV_HEADS, "draft_vocab_size": DRAFT_VOCAB, "aux_layer_ids": AUX, "ttt_steps": TTT}))
    subprocess.run([str(SPEC_PYTHON), "-m", "tests.helpers.speculators_drafters", "--out", str(tmp_path),
                    "--variants", json.dumps(VARIANTS)], cwd=REPO, check=True, timeout=600,
                   env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})

    # our position t of document d is their position t - d (each earlier document lost its last position); at
    # step i both have a teacher-forced token only where t + i is before the document's last position
    starts = torch.cumsum(torch.tensor([0] + LENGTHS[:-1]), 0)
    for name, options in VARIANTS.items():
        written = json.loads((tmp_path / name / "config.json").read_text())
        assert all(written[key] is value for key, value in options.items())  # the keys vLLM reads, top level
        model = Eagle3DraftModel.from_pretrained(tmp_path / name)
        assert {**model.config.eagle31_options(), "norm_before_residual": model.config.norm_before_residual} == {
            "norm_before_fc": False, "fc_norm": False, "norm_output": False, "norm_before_residual": False, **options}
        theirs = load_file(str(tmp_path / f"{name}.logits.safetensors"))
        with torch.no_grad():
            out = model(ids, aux, pos, doc, ttt_steps=TTT)
        for i in range(TTT):
            ours, compared = out.logits[i][0], 0
            for d, (start, n) in enumerate(zip(starts.tolist(), LENGTHS)):
                t = torch.arange(start, start + n - 1 - i)  # positions with a step-i token on both sides
                assert out.step_valid[i][0][t].all()
                torch.testing.assert_close(ours[t], theirs[f"step_{i}"][t - d], atol=1e-5, rtol=1e-5,
                                           msg=lambda m, name=name, i=i: f"{name}, step {i}: {m}")
                compared += len(t)
            assert compared == sum(LENGTHS) - len(LENGTHS) * (1 + i)
