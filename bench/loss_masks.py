"""What loss masks cost without the tokenizer's offsets (eagle3_hf/data/token_boundaries.py).

Renders the embedded default's conversations with SmolLM2's template once, then times the mask of each rendered
conversation three ways, alternately in rounds (best round kept): the fast tokenizer with offsets (what a fast
tokenizer uses), the fast tokenizer with the encoding proof (what a slow one needs), and the same vocabulary as a
slow remote-code tokenizer (tests/helpers/slow_tokenizer.py) with the encoding proof, beside that slow
tokenizer's bare encode of the text. `--turns N` joins N conversations into one of N user/assistant pairs;
`--text` instead masks plain text cut in the middle of a word (`prepare --text` with such a prompt: every boundary
needs the exact search, whose cost grows with the text). Checks on the way that every mask equals the offsets' one
and counts the conversations whose boundaries needed the exact search.

    python -m bench.loss_masks [--conversations 600] [--rounds 3] [--turns 1 | --text]

Prints JSON: ms per conversation of each way and their ratios.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def rendered(tokenizer: Any, convs: list[dict[str, Any]]) -> list[tuple[str, list[tuple[int, int]]]]:
    from eagle3_hf.data.prepare import NoLossTokens, apply_policies, assistant_spans

    out = []
    for conv in convs:
        try:
            out.append(assistant_spans(apply_policies(conv["messages"]), tokenizer, sample_id=conv["id"]))
        except NoLossTokens:
            continue
    return out


def mid_word_cuts(convs: list[dict[str, Any]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """(all answers of a conversation as one text, [(cut, end)]) with the cut inside its middle word."""
    out = []
    for conv in convs:
        answer = "\n".join(m["content"] for m in conv["messages"] if m["role"] == "assistant")
        words = [(i, w) for i, w in enumerate(answer.split(" ")) if len(w) > 3]
        if words:
            k, word = words[len(words) // 2]
            cut = len(" ".join(answer.split(" ")[:k])) + (1 if k else 0) + len(word) // 2
            out.append((answer, [(cut, len(answer))]))
    return out


def best_ms(fn: Callable[[], Any], rounds: int, n: int, results: dict[str, float], name: str) -> Any:
    start = time.perf_counter()
    out = fn()
    ms = (time.perf_counter() - start) * 1e3 / n
    results[name] = min(results.get(name, float("inf")), ms)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=600,
                        help="rows of the embedded default set to read (half are prompts without an answer: skipped)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=1, help="join this many conversations into one")
    parser.add_argument("--text", action="store_true",
                        help="each conversation's answers as plain text, the loss from the middle of a word on")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from eagle3_hf.data.conversations import load_conversations
    from eagle3_hf.data.token_boundaries import _by_pieces, encode, span_mask
    from eagle3_hf.verifier.loading import default_verifier_dir

    from tests.helpers.slow_tokenizer import install_slow_tokenizer

    fast = AutoTokenizer.from_pretrained(default_verifier_dir())
    with tempfile.TemporaryDirectory() as tmp:
        slow = AutoTokenizer.from_pretrained(install_slow_tokenizer(default_verifier_dir(), Path(tmp)),
                                             trust_remote_code=True)
    convs = load_conversations("default", limit=args.conversations * args.turns)
    if args.turns > 1:  # one user/assistant pair from each, joined
        convs = [{"id": f"joined{i}", "messages": [m for c in convs[i:i + args.turns] for m in c["messages"][:2]]}
                 for i in range(0, len(convs) - args.turns + 1, args.turns)]
    start = time.perf_counter()
    items = mid_word_cuts(convs) if args.text else rendered(fast, convs)
    n = len(items)
    render_ms = (time.perf_counter() - start) * 1e3 / max(n, 1)
    ways: dict[str, Callable[[], list[Any]]] = {
        "fast_offsets": lambda: [span_mask(fast, t, s, use_offsets=True) for t, s in items],
        "fast_encoding": lambda: [span_mask(fast, t, s, use_offsets=False) for t, s in items],
        "slow_encoding": lambda: [span_mask(slow, t, s) for t, s in items],
        "slow_bare_encode": lambda: [encode(slow, t) for t, _ in items],
    }
    ms: dict[str, float] = {}
    outputs: dict[str, list[Any]] = {}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            outputs[name] = best_ms(fn, args.rounds, n, ms, name)
    equal = sum(a == b == c for a, b, c in zip(outputs["fast_offsets"], outputs["fast_encoding"],
                                               outputs["slow_encoding"]))
    exact_search = sum(_by_pieces(fast, t, encode(fast, t), sorted({c for sp in s for c in sp})) is None
                       for t, s in items)
    print(json.dumps({
        "conversations": n, "turns_joined": args.turns, "text_cut_mid_word": args.text,
        "mean_tokens": round(sum(len(o[0]) for o in outputs["fast_offsets"]) / max(n, 1), 1),
        "mean_loss_spans": round(sum(len(s) for _, s in items) / max(n, 1), 2),
        "ms_per_conversation": {"render_spans_once": round(render_ms, 3), **{k: round(v, 3) for k, v in ms.items()}},
        "ratio_fast_encoding_over_offsets": round(ms["fast_encoding"] / ms["fast_offsets"], 2),
        "ratio_slow_encoding_over_slow_bare_encode": round(ms["slow_encoding"] / ms["slow_bare_encode"], 2),
        "masks_equal_all_three": f"{equal}/{n}",
        "needed_exact_search": exact_search,
    }, indent=1))


if __name__ == "__main__":
    main()
