"""Training prompts stay apart from MT-bench (all 80 questions, both turns) and from the development set:
exact and near-duplicate (eagle3_hf.demo_data.overlap), over every prompt of every demo size and every source in
full."""

from __future__ import annotations

import hashlib
import json

import pytest

from eagle3_hf.demo_data.overlap import find_overlaps, normalise
from eagle3_hf.demo_data.prompts import (
    DEV_PER_SOURCE,
    DEV_SOURCES,
    MTBENCH_OVERLAPS,
    chitchat_conversations,
    dev_prompts,
    instruction_sources,
    mtbench_questions,
    short_prompts,
    training_conversations,
)

DEMO_SIZES = {"tiny": 12, "small": 600, "large": 1200}  # examples/demo.sh


@pytest.fixture(scope="module")
def mt_bench():
    questions = mtbench_questions()
    assert len(questions) == 80 and sum(len(q["turns"]) for q in questions) == 160
    return questions


def test_overlap_definition_catches_retyped_and_embedded_questions():
    q = [{"id": "q", "turns": ["Write a C++ program to find the nth Fibonacci number using recursion."]}]
    retyped = {"id": "a", "messages": [{"role": "user", "content": "write a C++ program -- to find the NTH "
                                                                  "fibonacci number, using recursion!"}]}
    embedded = {"id": "b", "messages": [{"role": "user", "content": "Please help. Write a Python program to find "
                                                                    "the nth Fibonacci number using recursion."}]}
    apart = {"id": "c", "messages": [{"role": "user", "content": "Find the nth Fibonacci number in C++."}]}
    assert normalise(" Hello,   World!! ") == "hello world"
    found = {f["id"]: f["kind"] for f in find_overlaps([retyped, embedded, apart], q)}
    assert found == {"a": "exact", "b": "shared 8-gram"}


def test_every_demo_prompt_and_the_dev_set_are_apart_from_mt_bench(mt_bench):
    largest = short_prompts(max(DEMO_SIZES.values()))
    for size in DEMO_SIZES.values():  # each demo size draws a prefix of the largest
        assert short_prompts(size) == largest[:size]
    assert find_overlaps(largest, mt_bench) == []
    assert find_overlaps(dev_prompts(), mt_bench) == []


# The development set, pinned: a `--prompts dev` result (a sweep, a recipe choice) is comparable with a later one
# only if it ran on the same 40 prompts. A changed selection rule or source wheel moves them and fails here; if that
# is intended, re-pin (and rerun what was chosen on the old set).
DEV_SHA256 = "d65c083af50644daed6c13447d03fef87c939229723b1001acbdb73c6066c03c"  # json.dumps(dev, sort_keys=True)


def test_dev_set_is_fixed_and_no_training_pool_draws_it():
    dev = dev_prompts()
    ids = [d["id"] for d in dev]
    assert len(dev) == len(DEV_SOURCES) * DEV_PER_SOURCE and len(set(ids)) == len(dev)
    source = [next(s for s in DEV_SOURCES if i.startswith(s + "-")) for i in ids]
    assert source == list(DEV_SOURCES) * DEV_PER_SOURCE  # interleaved: one of each source in turn
    # AlpacaEval has 805 prompts (alpaca-eval-0 .. -804): its share is the last 8 of them, less alpaca-eval-801,
    # an MT-bench overlap (MTBENCH_OVERLAPS)
    assert [i for i in ids if i.startswith("alpaca-eval-")] == [f"alpaca-eval-{n}" for n in
                                                               (796, 797, 798, 799, 800, 802, 803, 804)]
    assert all(8 <= len(d["messages"][0]["content"]) <= 400 for d in dev)  # short single-turn prompts
    assert hashlib.sha256(json.dumps(dev, sort_keys=True).encode()).hexdigest() == DEV_SHA256, (
        "the development set changed: results on `--prompts dev` are no longer comparable with earlier ones")
    dev_ids = set(ids)
    assert not dev_ids & {p["id"] for p in short_prompts(3000)}  # beyond every demo size
    assert not dev_ids & {c["id"] for c in training_conversations()}
    # and not as text either (a prompt repeated under another id)
    assert find_overlaps(short_prompts(max(DEMO_SIZES.values())), dev) == []


def test_the_largest_sources_in_full_overlap_only_where_listed(mt_bench):
    found = set()
    for rows in [*instruction_sources().values(), chitchat_conversations()]:
        found |= {f["id"] for f in find_overlaps(rows, mt_bench)}
    assert found == MTBENCH_OVERLAPS  # every overlap is listed, so no pool draws it; none listed by mistake
    pool = {c["id"] for c in training_conversations()} | {p["id"] for p in short_prompts(3000)}
    assert not pool & MTBENCH_OVERLAPS
