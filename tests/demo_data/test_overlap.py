"""Training prompts stay apart from MT-bench (all 80 questions, both turns) and from the development set:
exact and near-duplicate (eagle3_hf.demo_data.overlap), over every prompt of every demo size and every source in
full."""

from __future__ import annotations

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


def test_dev_set_is_fixed_and_no_training_pool_draws_it():
    dev = dev_prompts()
    assert len(dev) == len(DEV_SOURCES) * DEV_PER_SOURCE and len({d["id"] for d in dev}) == len(dev)
    assert {d["id"].split("-")[0] for d in dev} == {s.split("-")[0] for s in DEV_SOURCES}
    assert dev == dev_prompts() and not any(d["id"].startswith("mt-bench") for d in dev)
    dev_ids = {d["id"] for d in dev}
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
