"""One contract for every drafter kind of the kinds' table (eagle3_hf/engines/table.py): trained two steps by the one
training script, saved in the layout its engines load, declared by config.json as that kind, reloaded by the class
the row names with the same weights, clean under `check`, and token-identical to plain greedy decoding in our decoder.
A new kind row fails here until its training flags below are written and every step holds."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf.decoding import greedy_generate, speculative_decode
from eagle3_hf.engines.table import KINDS, DrafterKind, drafter_kind
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.model.drafter_kind import checkpoint_drafter_kind
from eagle3_hf.publish.check import check_drafter
from eagle3_hf.scripts.train import main as train_main
from eagle3_hf.train.dflash_setup import tokens_present

from tests.helpers.data import COMMON, SYN_VOCAB

PROMPT = [3, 17, 42, 99, 7, 128, 5]


def kind_flags(kind: DrafterKind, features) -> list[str]:
    """`train`'s flags for a kind: what a user types to train it."""
    if kind.name == "eagle3":
        return []
    if kind.name == "dflash":
        present = tokens_present([FeatureDataset(features, "all", verify="none")], SYN_VOCAB)
        mask = int((~present).nonzero()[-1])  # a token the data never holds
        return ["--drafter-kind", "dflash", "--block-size", "4", "--dflash-layers", "1", "--dflash-anchors", "16",
                "--mask-token-id", str(mask)]
    raise AssertionError(f"drafter kind {kind.name!r} has no training flags in this contract test")


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_every_kind_trains_saves_reloads_checks_and_decodes_like_plain_greedy(kind, synthetic, tmp_path):
    out = tmp_path / kind.name
    train_main(["--verifier", str(synthetic["verifier_dir"]), "--features", str(synthetic["features"]),
                "--output-dir", str(out), "--max-steps", "2", "--eval-strategy", "no", "--save-strategy", "no",
                "--validation-fraction", "0.2", *COMMON, *kind_flags(kind, synthetic["features"])])

    assert drafter_kind(json.loads((out / "config.json").read_text())) is kind
    assert checkpoint_drafter_kind(out) is kind
    errors = [f for f in check_drafter(out, verifier=str(synthetic["verifier_dir"])) if f.level == "error"]
    assert not errors, errors

    verifier = synthetic["verifier"]
    drafter = kind.model_class().from_pretrained(out)
    drafter.load_verifier_embeddings(verifier)
    again = kind.model_class().from_pretrained(out)
    again.load_verifier_embeddings(verifier)
    state, reloaded = drafter.state_dict(), again.state_dict()
    assert state.keys() == reloaded.keys() and all(torch.equal(state[k], reloaded[k]) for k in state)

    plain = greedy_generate(verifier, PROMPT, 24, eos_token_id=[]).tokens
    spec = speculative_decode(verifier, drafter, PROMPT, steps=3, max_new_tokens=24, eos_token_id=[])
    assert spec.tokens == plain
