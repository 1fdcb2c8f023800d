"""Loss masks without offsets (eagle3_hf/data/token_boundaries.py) equal the masks by offsets, token for token: on
the SmolLM2 tokenizer dressed in each family's template (ChatML, Llama-3, DeepSeek-V3, Kimi), over every
conversation shape `prepare` handles, computed by encoding with the fast tokenizer and with the slow remote-code
tokenizer of the same vocabulary (tests/helpers/slow_tokenizer.py), against the fast tokenizer's offsets."""

from __future__ import annotations

import pytest

from eagle3_hf.data import token_boundaries
from eagle3_hf.data.prepare import new_stats, prepare_conversations, render_completion, render_with_mask
from eagle3_hf.data.token_boundaries import _by_pieces, encode

from tests.helpers.chat_templates import CALL, A, U, family_tokenizer

CONVERSATIONS = [
    {"id": "multi", "messages": [{"role": "system", "content": "Be brief."}, U("What is 2+2?"), A("2+2 is 4."),
                                 U("And 3+3?"), A("It is 6.")]},
    {"id": "greeting", "messages": [A("Welcome!"), U("Hi"), A("Hello there.")]},
    {"id": "tools", "messages": [U("Weather in Paris?"), A("", tool_calls=[CALL]),
                                 {"role": "tool", "content": '{"sky": "sunny"}'}, A("It is sunny in Paris.")]},
    {"id": "reasoning", "messages": [U("Hi"), A("Hello."), U("2+2?"), A("4.", reasoning_content="add two and two")]},
    {"id": "inline-think", "messages": [U("2+2?"), A("<think>hmm</think>\n\n4.")]},
    # a turn that starts with whitespace: its first token merges with the header's newline (a token across the edge)
    {"id": "edges", "messages": [U("Say it"), A("\n\n  indented\n\n"), U("日本語で"), A("日本語です。🙂 ok  "),
                                 U("more"), A(" leading space, trailing newline\n")]},
    {"id": "trailing-user", "messages": [U("q"), A("a"), U("unanswered")]},
]
OPTIONS = {
    "default": {},
    "drop": {"reasoning": "drop", "tool_calls": "drop"},
    "last-turn-only": {"last_turn_only": True},
    "split-turns": {"split_turns": True},
}
FAMILIES = ("chatml", "llama3", "deepseek", "kimi")
# plain text (`prepare --text`): prompts cut mid-word, mid-script, after a space, and nothing before the completion
COMPLETIONS = [("The capital of France is", " Paris."), ("Hel", "lo world"), ("The word 'Ро", "зница' ends."),
               ("中文提", "示的补全"), ("", "all of it"), ("trailing space ", "then text")]


@pytest.fixture(scope="module")
def tokenizers(default_verifier_dir, slow_remote_tokenizer_dir):
    """(fast, slow) per family: the slow one is the remote-code tokenizer dressed the same way."""
    out = {}
    for family in FAMILIES:
        if family == "chatml":
            from transformers import AutoTokenizer

            pair = (AutoTokenizer.from_pretrained(default_verifier_dir),
                    AutoTokenizer.from_pretrained(slow_remote_tokenizer_dir, trust_remote_code=True))
        else:
            pair = (family_tokenizer(default_verifier_dir, family),
                    family_tokenizer(slow_remote_tokenizer_dir, family, trust_remote_code=True))
        assert not pair[1].is_fast and pair[0].is_fast
        out[family] = pair
    return out


def prepared(tokenizer, monkeypatch, offsets: bool, **options):
    with monkeypatch.context() as m:
        m.setattr(token_boundaries, "has_offsets", lambda tok: offsets)
        stats = new_stats()
        ds = prepare_conversations(CONVERSATIONS, tokenizer, stats=stats, **options)
    return ds.to_dict(), dict(stats["skipped"])


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_masks_by_encoding_equal_masks_by_offsets(tokenizers, family, options, monkeypatch):
    fast, slow = tokenizers[family]
    # a template without thinking syntax takes the reasoning inline only when asked (else the sample is refused)
    opts = OPTIONS[options] if family == "kimi" else {"reasoning": "inline", **OPTIONS[options]}
    by_offsets = prepared(fast, monkeypatch, True, **opts)  # Kimi's earlier reasoning: one sample per turn
    assert by_offsets[0]["id"] and sum(map(sum, by_offsets[0]["loss_mask"])) > 0
    assert prepared(fast, monkeypatch, False, **opts) == by_offsets
    assert prepared(slow, monkeypatch, False, **opts) == by_offsets  # the slow tokenizer: same ids, same masks


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_text_masks_by_encoding_equal_masks_by_offsets(tokenizers, family, monkeypatch):
    fast, slow = tokenizers[family]
    for prompt, completion in COMPLETIONS:
        with monkeypatch.context() as m:
            expected = render_completion(prompt, completion, fast)
            m.setattr(token_boundaries, "has_offsets", lambda tok: False)
            assert render_completion(prompt, completion, fast) == expected, (prompt, completion)
            assert render_completion(prompt, completion, slow) == expected, (prompt, completion)


def test_a_token_across_a_turn_edge_belongs_to_the_turn_it_starts_in(tokenizers, monkeypatch):
    """ChatML's header ends in a newline; an answer that starts with two more is one token `\\n\\n` from the header
    then `\\n`: the first is context (it starts in the header), the second is loss. The pieces between boundaries
    do not add up here, so the exact search decides, as the offsets do."""
    fast, slow = tokenizers["chatml"]
    convo = [U("Say it"), A("\n\nHello")]
    ids, mask = render_with_mask(convo, fast)
    loss = [i for i, m in zip(ids, mask) if m]
    assert fast.decode(loss) == "\nHello<|im_end|>"
    edge = ids.index(fast.convert_tokens_to_ids("ĊĊ"))
    assert mask[edge] == 0 and mask[edge + 1] == 1
    text = fast.apply_chat_template(convo, tokenize=False)
    start = len(fast.apply_chat_template(convo[:1], tokenize=False, add_generation_prompt=True))
    assert _by_pieces(slow, text, encode(slow, text), [start]) is None  # the cheap proof fails: exact search
    monkeypatch.setattr(token_boundaries, "has_offsets", lambda tok: False)
    assert render_with_mask(convo, slow) == render_with_mask(convo, fast) == (ids, mask)


def test_several_tokens_between_proven_boundaries_are_placed_by_their_text(tokenizers, monkeypatch):
    """A prompt cut inside a Cyrillic word, where one token holds `о` and the first byte of `з`: no boundary inside
    the word is proven by encoding, so each token's start comes from the text its preceding ids decode to (that token
    starts in `о`: context; the next, `з`'s second byte, starts in the completion: loss)."""
    fast, slow = tokenizers["chatml"]
    calls = []
    decoded = token_boundaries._PrefixProver.decoded
    monkeypatch.setattr(token_boundaries._PrefixProver, "decoded", lambda self, k: calls.append(k) or decoded(self, k))
    expected = render_completion("The word 'Ро", "зница' ends.", fast)
    monkeypatch.setattr(token_boundaries, "has_offsets", lambda tok: False)
    assert render_completion("The word 'Ро", "зница' ends.", slow) == expected
    assert calls  # the several-token branch ran


def test_a_boundary_that_cannot_be_placed_skips_the_sample_by_name(tokenizers, monkeypatch):
    _, slow = tokenizers["chatml"]
    monkeypatch.setattr(token_boundaries._PrefixProver, "decoded", lambda self, k: "not the text")
    stats = new_stats()
    ds = prepare_conversations([{"id": "cut", "prompt": "The word 'Ро", "completion": "зница' ends."},
                                {"id": "fine", "prompt": "Hello", "completion": " world."}], slow, stats=stats,
                               text=True)
    assert ds["id"] == ["fine"]
    reason = "a loss boundary inside a token the tokenizer gives no offsets for"
    assert dict(stats["skipped"]) == {reason: 1} and stats["skipped_ids"][reason] == ["cut"]


@pytest.mark.parametrize("mode", ["chat", "split-turns", "text"])
def test_prepare_with_a_slow_remote_code_tokenizer_writes_the_fast_tokenizers_ids_and_masks(
        tmp_path, tiny_verifier_dir, slow_remote_tokenizer_dir, mode, capsys):
    """`prepare --trust-remote-code` with a slow tokenizer shipped as remote code (Kimi-K2.5's kind: no offsets)
    writes exactly what the fast tokenizer of the same vocabulary writes; only the recorded class differs."""
    from eagle3_hf import cli
    from eagle3_hf.data.conversations import write_jsonl
    from eagle3_hf.data.prepared_format import load_prepared
    from eagle3_hf.verifier import remote_code

    rows = [{"id": f"t{i}", "prompt": p, "completion": c} for i, (p, c) in enumerate(COMPLETIONS)] \
        if mode == "text" else CONVERSATIONS
    write_jsonl(tmp_path / "in.jsonl", rows)
    # ChatML has no thinking syntax: the reasoning conversation's reasoning goes inline only when asked
    extra = {"chat": ["--reasoning", "inline"], "split-turns": ["--split-turns", "--reasoning", "inline"],
             "text": ["--text"]}[mode]
    out = {}
    try:
        for name, tokenizer, trust in (("fast", tiny_verifier_dir, []),
                                       ("slow", slow_remote_tokenizer_dir, ["--trust-remote-code"])):
            assert cli.main(["prepare", "--tokenizer", str(tokenizer), "--input", str(tmp_path / "in.jsonl"),
                             "--output", str(tmp_path / name), *extra, *trust]) == 0
            out[name] = load_prepared(tmp_path / name)
    finally:
        remote_code.set_trusted(False)
    assert "Traceback" not in capsys.readouterr().err
    (fast, fast_meta), (slow, slow_meta) = out["fast"], out["slow"]
    assert len(fast) > 0 and slow.to_dict() == fast.to_dict()
    assert slow_meta["counts"] == fast_meta["counts"]
    assert slow_meta["tokenizer_fingerprint"] == fast_meta["tokenizer_fingerprint"]
    assert (fast_meta["tokenizer_class"], fast_meta["trust_remote_code"]) == ("TokenizersBackend", False)
    assert (slow_meta["tokenizer_class"], slow_meta["trust_remote_code"]) == ("SlowByteLevelBPETokenizer", True)
