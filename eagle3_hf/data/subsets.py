"""Representative training subsets for data-scaling curves: whole samples, seeded, stratified by prompt source.

The first N tokens in manifest order are not a sample of the data: shards come rank by rank and each
generation batch longest-prompt-first, so length and source mix would change along the curve. Here every
source is shuffled on its own (seeded, independent of manifest order), the sources are interleaved in
proportion to their size, and a budget takes the longest prefix of that order that fits. A smaller budget
is then a prefix of a larger one (nested subsets), and any prefix has about the full mix of sources.
"""

from __future__ import annotations

import random
import re
from collections import Counter

# the embedded default's prompt sources (eagle3_hf.verifier.loading); other ids fall back to their leading words
KNOWN_SOURCES = ("alpaca-eval", "arena-hard", "chitchat", "healthbench", "humaneval", "ifbench", "ifeval",
                 "mt-bench", "writingbench")
_LEADING_WORDS = re.compile(r"^[A-Za-z_]+(?:-[A-Za-z_]+)*(?=-|$)")


def source_of(sample_id: str) -> str:
    """The prompt source a sample id names: a known prefix, else its leading non-numeric words ("row-17": "row")."""
    for name in KNOWN_SOURCES:
        if sample_id == name or sample_id.startswith(name + "-"):
            return name
    found = _LEADING_WORDS.match(sample_id)
    return found.group(0) if found else "other"


def stratified_order(sample_ids: list[str], seed: int) -> list[int]:
    """Indices of `sample_ids` in a seeded order whose every prefix keeps each source's share of the whole.

    Each source's samples are sorted by id then shuffled with their own seeded generator; the next sample
    always comes from the source furthest behind its share ((taken + 0.5) / size smallest, ties by name).
    """
    by_source: dict[str, list[int]] = {}
    for i in sorted(range(len(sample_ids)), key=lambda i: sample_ids[i]):
        by_source.setdefault(source_of(sample_ids[i]), []).append(i)
    for name, members in by_source.items():
        random.Random(f"{seed}:{name}").shuffle(members)
    taken = dict.fromkeys(by_source, 0)
    order: list[int] = []
    while len(order) < len(sample_ids):
        name = min((n for n in by_source if taken[n] < len(by_source[n])),
                   key=lambda n: ((taken[n] + 0.5) / len(by_source[n]), n))
        order.append(by_source[name][taken[name]])
        taken[name] += 1
    return order


def token_subset(sample_ids: list[str], lengths: list[int], max_tokens: int, seed: int = 0) -> list[int]:
    """The samples (indices, in their original order) of the longest prefix of `stratified_order` whose
    lengths sum to at most max_tokens: whole samples, nested across budgets."""
    chosen, total = [], 0
    for i in stratified_order(sample_ids, seed):
        if total + int(lengths[i]) > max_tokens:
            break
        chosen.append(i)
        total += int(lengths[i])
    return sorted(chosen)


def describe(sample_ids: list[str], lengths: list[int]) -> dict:
    """What a subset is made of: samples, tokens, mean length and the share of each source."""
    counts = Counter(source_of(s) for s in sample_ids)
    n = len(sample_ids)
    return {"samples": n, "tokens": int(sum(lengths)), "mean_length": sum(lengths) / n if n else 0.0,
            "sources": {name: counts[name] / n for name in sorted(counts)}}
