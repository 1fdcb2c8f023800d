"""The embedded default's prompt sets: what the demo trains on and what it is evaluated on stay apart."""

from __future__ import annotations

from collections import Counter

from eagle3_hf.demo_data.prompts import mtbench_questions, short_prompts


def test_training_prompts_are_instruction_weighted_and_never_mt_bench():
    prompts = short_prompts(400)
    assert len(prompts) == 400 and len({p["id"] for p in prompts}) == 400
    sources = Counter(p["id"].split("-")[0] for p in prompts)
    assert sources["chitchat"] <= len(prompts) // 7  # one source of eight
    assert len(sources) >= 7
    mt_bench = {q["turns"][0].strip() for q in mtbench_questions()}
    assert not any(p["messages"][0]["content"].strip() in mt_bench for p in prompts)
    assert all(8 <= len(p["messages"][0]["content"]) <= 400 for p in prompts)


def test_mt_bench_subset_covers_every_category():
    ten = mtbench_questions(10)
    assert len({q["category"] for q in ten}) == 8
    assert len(mtbench_questions()) == 80 and mtbench_questions(80) == mtbench_questions()
