"""Data-scaling subsets (eagle3_hf/data/subsets.py): nested, stratified by prompt source, fixed by the seed."""

from __future__ import annotations

import random
from collections import Counter

from eagle3_hf.data.subsets import describe, source_of, stratified_order, token_subset


def _pool(seed: int = 0):
    """Ids as the demo writes them, sources of very different sizes, in manifest order (sorted by length)."""
    rng = random.Random(seed)
    ids = ([f"alpaca-eval-{i}" for i in range(300)] + [f"chitchat-{rng.getrandbits(64):016x}" for i in range(100)]
           + [f"healthbench-{rng.getrandbits(32):08x}-a1" for i in range(50)] + [f"row-{i}" for i in range(50)])
    lengths = [rng.randint(20, 400) for _ in ids]
    by_length = sorted(range(len(ids)), key=lambda i: -lengths[i])  # longest first, like a generation batch
    return [ids[i] for i in by_length], [lengths[i] for i in by_length]


def test_source_of_names_the_prompt_source():
    assert source_of("alpaca-eval-12") == "alpaca-eval" and source_of("ifeval-3750") == "ifeval"
    assert source_of("healthbench-c5f6bb12-a633") == "healthbench" and source_of("ifbench-3") == "ifbench"
    assert source_of("chitchat-ffbeaced-0a1") == "chitchat"  # a hex part with no digit is still the id
    assert source_of("row-17") == "row" and source_of("my-data-0001") == "my-data" and source_of("42") == "other"


def test_subsets_are_nested_stratified_and_seed_determined():
    ids, lengths = _pool()
    total = sum(lengths)
    budgets = [total // 16, total // 8, total // 4, total // 2, total]
    subsets = [token_subset(ids, lengths, b, seed=3) for b in budgets]
    for small, large in zip(subsets, subsets[1:]):
        assert set(small) < set(large)  # nested
    assert subsets[-1] == list(range(len(ids)))
    full_mix = describe(ids, lengths)["sources"]
    for budget, chosen in zip(budgets, subsets):
        picked = describe([ids[i] for i in chosen], [lengths[i] for i in chosen])
        assert picked["tokens"] <= budget
        assert picked["tokens"] + max(lengths) > budget  # whole samples: stops only when the next would not fit
        for name, share in full_mix.items():  # each source keeps its share, to one sample
            assert abs(picked["sources"].get(name, 0.0) - share) <= 1.0 / picked["samples"] + 1e-9, (budget, name)
    # not the longest-first manifest prefix: mean length of the smallest subset near the whole's
    small = [lengths[i] for i in subsets[0]]
    assert abs(sum(small) / len(small) - total / len(ids)) < 0.25 * total / len(ids)
    # seed-determined and independent of manifest order
    assert token_subset(ids, lengths, budgets[1], seed=3) == subsets[1]
    assert token_subset(ids, lengths, budgets[1], seed=4) != subsets[1]
    perm = list(range(len(ids)))
    random.Random(9).shuffle(perm)
    shuffled = token_subset([ids[i] for i in perm], [lengths[i] for i in perm], budgets[1], seed=3)
    assert sorted(ids[perm[i]] for i in shuffled) == sorted(ids[i] for i in subsets[1])


def test_every_prefix_of_the_order_keeps_the_mix():
    ids, _ = _pool(1)
    order = stratified_order(ids, seed=0)
    assert sorted(order) == list(range(len(ids)))
    sizes = Counter(source_of(s) for s in ids)
    for n in (10, 37, 100, 250):
        got = Counter(source_of(ids[i]) for i in order[:n])
        for name, size in sizes.items():
            assert abs(got[name] - n * size / len(ids)) <= 1, (n, name)
