"""`--tree-attention`: SGLang's drafting attention (each of the K slots reads its own earlier entries) against
the ancestors rule (each node reads its true path), both checked against a reference written from SGLang's
source (tests/helpers/sglang_tree.py) that runs every slot as its own decode call."""

from __future__ import annotations

import pytest
import torch

from eagle3_hf.decoding import speculative_decode
from eagle3_hf.decoding.tree import draft_tree, num_candidates

from tests.helpers.assertions import assert_matches_greedy
from tests.helpers.drafters import random_drafter
from tests.helpers.sglang_tree import sglang_draft_tree
from tests.helpers.verifiers import lively_verifier


@pytest.fixture(scope="module")
def pair():
    verifier = lively_verifier()
    return verifier, random_drafter(verifier, scale=3.0)  # outputs depend on the context they attend to


def _root(verifier, drafter, prompt: list[int]):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = verifier(ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in drafter.config.aux_hidden_state_indices], -1)
        logits, hidden, cache = drafter.draft_step(ids[:, 1:], aux[:, :-1], torch.arange(len(prompt) - 1)[None])
    return logits[0, -1], hidden[:, -1:], cache, prompt[-1], len(prompt) - 1


def _trees(pair, prompt, steps, topk, size):
    verifier, drafter = pair
    logits, hidden, cache, root, position = _root(verifier, drafter, prompt)
    with torch.no_grad():
        ours = {rule: draft_tree(drafter, logits, hidden, cache, root, position, steps, topk, size, attention=rule)
                for rule in ("sglang", "ancestors")}
        ref = {rule: sglang_draft_tree(drafter, logits, hidden, cache, root, position, steps, topk, size,
                                       per_slot_kv=rule == "sglang") for rule in ("sglang", "ancestors")}
    return ({rule: (t.tokens, t.parents, t.depths) for rule, t in ours.items()}, ref)


PROMPTS = [list(range(1000 + 13 * p, 1012 + 13 * p)) for p in range(4)]


@pytest.mark.parametrize("steps,topk,size", [(3, 3, 9), (4, 2, 1 + num_candidates(4, 2)), (5, 4, 16)])
def test_each_rule_drafts_the_tree_its_reference_drafts(pair, steps, topk, size):
    for prompt in PROMPTS:
        ours, ref = _trees(pair, prompt, steps, topk, size)
        assert ours["sglang"] == ref["sglang"], f"SGLang's rule, prompt {prompt[0]}"
        assert ours["ancestors"] == ref["ancestors"], f"ancestors rule, prompt {prompt[0]}"


def test_the_rules_agree_for_two_steps_and_part_from_the_third(pair):
    differ = 0
    for prompt in PROMPTS:
        two, _ = _trees(pair, prompt, 2, 4, 1 + num_candidates(2, 4))
        assert two["sglang"] == two["ancestors"]  # step 2 reads only depth-1 nodes: the slot is the parent
        three, ref = _trees(pair, prompt, 4, 4, 1 + num_candidates(4, 4))
        differ += three["sglang"] != three["ancestors"]
        assert ref["sglang"] != ref["ancestors"] or three["sglang"] == three["ancestors"]
    assert differ >= 2, "a context-dependent drafter must tell the rules apart on most prompts"


def test_topk_one_is_the_chain_under_both_rules(pair):
    for prompt in PROMPTS[:2]:
        ours, _ = _trees(pair, prompt, 4, 1, 5)
        assert ours["sglang"] == ours["ancestors"]


@pytest.mark.parametrize("rule", ["sglang", "ancestors"])
def test_both_rules_decode_losslessly(pair, rule):
    verifier, drafter = pair
    prompt = torch.tensor([PROMPTS[0]])
    out = speculative_decode(verifier, drafter, prompt, steps=4, topk=3, num_draft_tokens=10, max_new_tokens=24,
                             eos_token_id=[], tree_attention=rule)
    assert_matches_greedy(verifier, prompt, 24, out, eos_token_id=[])
