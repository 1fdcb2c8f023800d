"""One definition of "this training prompt is (nearly) an evaluation prompt", for the tests and the docs.

Two texts overlap when their normalised forms are equal (lowercase, punctuation and whitespace collapsed: the
same question retyped), or when they share a run of `NGRAM` consecutive normalised words (the same question
with a changed preamble, or one quoted inside a longer prompt). Eight words is long enough that stock phrases
("in no more than 100 words") do not match and short enough that a paraphrase keeping one clause does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

NGRAM = 8
_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalise(text: str) -> str:
    """Lowercase, every run of punctuation/whitespace to one space, stripped."""
    return _NON_WORD.sub(" ", text.lower()).strip()


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = normalise(text).split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def user_turns(row: dict) -> list[str]:
    """The user text of a conversation (`messages`) or a question (`turns`)."""
    if isinstance(row.get("turns"), list):
        return [str(t) for t in row["turns"]]
    return [m["content"] for m in row.get("messages", []) if m.get("role") == "user"]


class OverlapIndex:
    """Evaluation texts indexed for exact-normalised and shared-n-gram lookups."""

    def __init__(self, evaluation: Iterable[dict], n: int = NGRAM):
        self.n = n
        self.exact: dict[str, str] = {}
        self.grams: dict[tuple[str, ...], str] = {}
        for row in evaluation:
            for turn, text in enumerate(user_turns(row)):
                where = f"{row['id']} turn {turn + 1}"
                self.exact.setdefault(normalise(text), where)
                for gram in ngrams(text, n):
                    self.grams.setdefault(gram, where)

    def match(self, text: str) -> tuple[str, str] | None:
        """(kind, evaluation turn) of the first overlap of `text`, or None."""
        norm = normalise(text)
        if norm and norm in self.exact:
            return "exact", self.exact[norm]
        for gram in ngrams(text, self.n):
            if gram in self.grams:
                return f"shared {self.n}-gram", self.grams[gram]
        return None


def find_overlaps(training: Iterable[dict], evaluation: Iterable[dict], n: int = NGRAM) -> list[dict]:
    """Every training row with a user turn that overlaps an evaluation turn: [{"id", "kind", "matches"}]."""
    index = OverlapIndex(evaluation, n)
    found = []
    for row in training:
        for text in user_turns(row):
            hit = index.match(text)
            if hit:
                found.append({"id": row["id"], "kind": hit[0], "matches": hit[1]})
                break
    return found


def unique_rows(rows: list[dict], n: int = NGRAM) -> list[dict]:
    """The rows that overlap no other row of `rows` (greetings like "hi, how are you?" recur in chat data)."""
    from collections import Counter

    keys = [[normalise(t) for t in user_turns(r)] + [g for t in user_turns(r) for g in ngrams(t, n)] for r in rows]
    seen = Counter(k for row_keys in keys for k in set(row_keys))
    return [r for r, row_keys in zip(rows, keys) if all(seen[k] == 1 for k in set(row_keys))]
