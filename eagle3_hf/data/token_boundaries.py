"""Which tokens carry loss, given character spans of the rendered text: with or without the tokenizer's offsets.

The rule (shared by `prepare` and `regenerate --features-out`): a token belongs to the span it STARTS in, so a
token that straddles a span's start (a header's newline merged with the answer's first character) is context,
and one that straddles its end is loss.

A fast tokenizer gives each token's start (`return_offsets_mapping`). A slow one (transformers 5's `PythonBackend`:
Kimi-K2.5's remote-code `TikTokenTokenizer`) gives none, so the number of tokens that start before a span
boundary c is proven by encoding: when encode(text[:c]) is a prefix of the whole text's ids, those tokens spell
exactly text[:c], so c is a token boundary. The cheap form encodes the pieces between boundaries (one more
encode of the text in all) and accepts them only when they add up to the whole encoding; where a token straddles
a boundary, the prefixes around it are encoded until a proven boundary lies on each side: one token between
them starts before c; of several (a word cut mid-token by `--text`'s prompt, whose own prefix encodes otherwise),
those whose preceding ids decode to fewer than c characters of the text. This needs a tokenizer whose tokens spell
fixed strings that concatenate to the text (a byte-level BPE: tiktoken, GPT-2, Llama-3, Qwen, DeepSeek, Kimi); a
boundary it cannot place (no proven boundary within SEARCH_CHARS, or a decoding that is not the text) makes the
sample `BoundaryInsideToken`, skipped and counted by name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# how far (characters) the exact search looks for a proven boundary on either side of a straddled one: a token
# longer than this (runs of 100+ spaces or dashes can be one token) around a boundary leaves it unplaced
SEARCH_CHARS = 256


class BoundaryInsideToken(ValueError):
    """A loss boundary the tokenizer (no offsets) cannot place: the sample is skipped and counted."""


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """The ids `prepare` writes for rendered text: the tokenizer's own call, no special tokens added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def has_offsets(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "is_fast", False))


def span_mask(tokenizer: PreTrainedTokenizerBase, text: str, spans: Sequence[tuple[int, int]],
              sample_id: str = "sample", use_offsets: bool | None = None) -> tuple[list[int], list[int]]:
    """(ids of `text`, loss mask): 1 on the tokens that start inside one of `spans` ([a, b) in characters).

    `use_offsets` None: offsets where the tokenizer has them (the cheaper way); False forces the encoding proof
    (the equality tests compare both on fast tokenizers)."""
    if use_offsets is None:
        use_offsets = has_offsets(tokenizer)
    if use_offsets:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        starts = np.fromiter((s for s, _ in enc["offset_mapping"]), dtype=np.int64, count=len(ids))
        mask = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        return ids, mask.astype(np.int8).tolist()
    ids = encode(tokenizer, text)
    counts = tokens_before(tokenizer, text, ids, [c for span in spans for c in span], sample_id)
    out = np.zeros(len(ids), dtype=np.int8)
    for a, b in spans:
        out[counts[a]:counts[b]] = 1
    return ids, out.tolist()


def tokens_before(tokenizer: PreTrainedTokenizerBase, text: str, ids: list[int], positions: Sequence[int],
                  sample_id: str = "sample") -> dict[int, int]:
    """{c: how many of `ids` (the encoding of `text`) start before character c} for each c in `positions`,
    proven by encoding (module docstring)."""
    wanted = sorted({min(max(int(c), 0), len(text)) for c in positions})
    by_pieces = _by_pieces(tokenizer, text, ids, wanted)
    if by_pieces is not None:
        return by_pieces
    prover = _PrefixProver(tokenizer, text, ids)
    return {c: prover.count_before(c, sample_id) for c in wanted}


def _by_pieces(tokenizer: PreTrainedTokenizerBase, text: str, ids: list[int],
               wanted: list[int]) -> dict[int, int] | None:
    """Encode the pieces between boundaries; their ids laid end to end must be the whole text's ids, else None.
    (A tokenizer that adds or drops characters per call, e.g. a leading space, cannot add up with two pieces or
    more.)"""
    counts: dict[int, int] = {}
    k = p = 0
    for c in wanted:
        if c > p:
            piece = encode(tokenizer, text[p:c])
            if ids[k:k + len(piece)] != piece:
                return None
            k, p = k + len(piece), c
        counts[c] = k
    return counts if encode(tokenizer, text[p:]) == ids[k:] else None


class _PrefixProver:
    """Token boundaries proven by encoding prefixes of the text: proven[p] = k when encode(text[:p]) = ids[:k]."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, text: str, ids: list[int]):
        self.tok, self.text, self.ids = tokenizer, text, ids
        self.proven: dict[int, int | None] = {0: 0, len(text): len(ids)}

    def proof(self, p: int) -> int | None:
        if p not in self.proven:
            prefix = encode(self.tok, self.text[:p])
            self.proven[p] = len(prefix) if self.ids[:len(prefix)] == prefix else None
        return self.proven[p]

    def count_before(self, c: int, sample_id: str) -> int:
        k = self.proof(c)
        if k is not None:
            return k
        below = next(((p, k) for p in range(c - 1, max(c - SEARCH_CHARS, 0) - 1, -1)
                      if (k := self.proof(p)) is not None), None)
        above = next(((p, k) for p in range(c + 1, min(c + SEARCH_CHARS, len(self.text)) + 1)
                      if (k := self.proof(p)) is not None), None)
        if below is not None and above is not None:
            (p1, k1), (p2, k2) = below, above
            if k2 == k1 + 1:
                return k2  # one token spans [p1, p2): it starts before c
            if self.decoded(k1) == self.text[:p1] and self.decoded(k2) == self.text[:p2]:
                # several: token k starts before c iff the text its prefix ids[:k] spells (a character cut by a token
                # edge decodes as U+FFFD) agrees with the text on fewer than c characters
                return k1 + 1 + sum(_common_prefix(self.decoded(k), self.text) < c for k in range(k1 + 1, k2))
        raise BoundaryInsideToken(f"sample {sample_id}: a loss boundary at character {c} lies inside tokens this "
                                  "tokenizer gives no offsets for")

    def decoded(self, k: int) -> str:
        return str(self.tok.decode(self.ids[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))
