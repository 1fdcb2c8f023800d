"""Thinking verifiers trained on their thinking (`prepare --reasoning`, eagle3_hf/data/reasoning.py), on templates
written here that behave as Kimi-K2.5's, Qwen3's and DeepSeek-R1's (tests/helpers/thinking_templates.py): the
reasoning carries loss as the model emitted it, and data without reasoning gets the masks it got before."""

from __future__ import annotations

import hashlib
import json

import pytest

from eagle3_hf import cli
from eagle3_hf.data.conversations import write_jsonl
from eagle3_hf.data.prepare import new_stats, prepare_conversations, render_samples
from eagle3_hf.data.prepared_format import load_prepared
from eagle3_hf.data.vocab import token_counts

from tests.helpers.chat_templates import CALL, A, U, family_tokenizer
from tests.helpers.thinking_templates import QWEN3_TEMPLATE, thinking_tokenizer

NON_THINKING = [
    {"id": "multi", "messages": [{"role": "system", "content": "Be brief."}, U("What is 2+2?"), A("2+2 is 4."),
                                 U("And 3+3?"), A("It is 6.")]},
    {"id": "single", "messages": [U("Name a colour."), A("Blue.")]},
    {"id": "greeting", "messages": [A("Welcome!"), U("Hi"), A("Hello there.")]},
    {"id": "tools", "messages": [U("Weather in Paris?"), A("", tool_calls=[CALL]),
                                 {"role": "tool", "content": '{"sky": "sunny"}'}, A("It is sunny in Paris.")]},
    {"id": "edges", "messages": [U("Say it"), A("\n\n  indented\n\n"), U("日本語で"), A("日本語です。🙂 ok  ")]},
    {"id": "trailing-user", "messages": [U("q"), A("a"), U("unanswered")]},
]
OPTIONS = {
    "default": {},
    "drop": {"reasoning": "drop", "tool_calls": "drop"},
    "last-turn-only": {"last_turn_only": True},
    "split-turns": {"split_turns": True},
}
# sha256 (first 16 hex) of prepare's output (ids, input_ids, loss_mask) on NON_THINKING with the SmolLM2 tokenizer in
# each template, computed with prepare as it was before reasoning was trained through the templates' blanks (the
# same function, the same data, these templates); "refused": it raised a ValueError then and must still.
BEFORE = {
    "chatml/default": "093a90d911b7f300", "chatml/drop": "9d7a9ede1afdad98",
    "chatml/last-turn-only": "c5dbf0823425e51f", "chatml/split-turns": "7e2cc51cfead3d56",
    "llama3/default": "070a18eae53fd52a", "llama3/drop": "9cb590ac6b96db1b",
    "llama3/last-turn-only": "ed1b25b3fedeae3d", "llama3/split-turns": "dfb9a0dda8c5689d",
    "deepseek/default": "0a1de685af5c620d", "deepseek/drop": "3f85973b8c5e8137",
    "deepseek/last-turn-only": "664ed7cfcbd7f278", "deepseek/split-turns": "13ae57b1c9dcbec9",
    "kimi/default": "caa4af036a513554", "kimi/drop": "dfbdbe2ef50feb83",
    "kimi/last-turn-only": "8b307f964d058261", "kimi/split-turns": "49e8c8d53d97706b",
    "k25-bare/default": "06173f92de7ea6fd", "k25-bare/drop": "c0d040a812f3a61a",
    "k25-bare/last-turn-only": "7eb434afcdeaee8e", "k25-bare/split-turns": "397ec4245310245a",
    "qwen3/default": "refused", "qwen3/drop": "refused",
    "qwen3/last-turn-only": "c33c8aca349c805d", "qwen3/split-turns": "1d8f230bddd6694d",
    "r1/default": "refused", "r1/drop": "refused", "r1/last-turn-only": "refused", "r1/split-turns": "refused",
}


@pytest.fixture(scope="module")
def families(default_verifier_dir):
    from transformers import AutoTokenizer

    out = {"chatml": AutoTokenizer.from_pretrained(default_verifier_dir)}
    out.update({f: family_tokenizer(default_verifier_dir, f) for f in ("llama3", "deepseek", "kimi")})
    out.update({f: thinking_tokenizer(default_verifier_dir, f) for f in ("k25", "k25-bare", "qwen3", "r1")})
    return out


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("family", ("chatml", "llama3", "deepseek", "kimi", "k25-bare", "qwen3", "r1"))
def test_data_without_reasoning_is_prepared_byte_for_byte_as_before(families, family, options):
    try:
        ds = prepare_conversations(NON_THINKING, families[family], stats=new_stats(), **OPTIONS[options]).to_dict()
        got = hashlib.sha256(json.dumps(ds, sort_keys=True).encode()).hexdigest()[:16]
    except ValueError:
        got = "refused"
    assert got == BEFORE[f"{family}/{options}"]


def segments(tok, ids: list[int], mask: list[int]) -> list[str]:
    runs: list[list[int]] = [[]]
    for i, m in zip(ids, mask):
        if m:
            runs[-1].append(i)
        elif runs[-1]:
            runs.append([])
    return [tok.decode(r) for r in runs if r]


def reasoning_loss_tokens(tok, ids: list[int], mask: list[int], thought: str) -> int:
    """Loss tokens that start inside `thought` in the sample's text (by the fast tokenizer's offsets)."""
    text = tok.decode(ids)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids  # the text is the sample's
    start = text.index(thought)
    return sum(m for m, (a, _) in zip(mask, enc["offset_mapping"]) if start <= a < start + len(thought))


THOUGHT = "count the zebras twice"
ASK = [U("How many zebras?")]
# the turn as each model emits it after its generation prompt; Kimi-K2.5's prompt already holds `<think>`, R1's
# `<think>\n`
EMITTED = {
    "k25": ("<|im_assistant|>assistant<|im_middle|><think>", f"{THOUGHT}</think>Four.<|im_end|>"),
    "qwen3": ("<|im_start|>assistant\n", f"<think>\n{THOUGHT}\n</think>\n\nFour.<|im_end|>\n"),
    "r1": ("<｜Assistant｜><think>\n", f"{THOUGHT}\n</think>\n\nFour.<｜end▁of▁sentence｜>"),
}


@pytest.mark.parametrize("family", EMITTED)
@pytest.mark.parametrize("given", ["reasoning_content", "inline"])
def test_reasoning_carries_loss_as_the_model_emitted_it(families, family, given):
    tok = families[family]
    answer = A("Four.", reasoning_content=THOUGHT) if given == "reasoning_content" else \
        A(f"<think>{THOUGHT}</think>Four.") if family == "k25" else A(f"<think>\n{THOUGHT}\n</think>\n\nFour.")
    [(sid, ids, mask, turns)] = render_samples(ASK + [answer], tok, sample_id="s")
    prompt, emitted = EMITTED[family]
    assert (sid, turns) == ("s", 1) and segments(tok, ids, mask) == [emitted.rstrip("\n")]
    assert tok.decode(ids) == tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False) + emitted
    assert tok.decode(ids).endswith(prompt + emitted)
    assert reasoning_loss_tokens(tok, ids, mask, THOUGHT) >= 5
    # the same turn with --reasoning drop: the answer as the template renders it, no reasoning token trained
    if family != "r1":  # R1's generation prompt opens a block its rendered answers lack: refused as before
        [(_, ids, mask, turns)] = render_samples(ASK + [answer], tok, sample_id="s", reasoning="drop")
        assert turns == 0 and "zebra" not in "".join(segments(tok, ids, mask))


@pytest.mark.parametrize("family", EMITTED)
def test_every_turn_keeps_its_reasoning_where_the_template_blanks_history(families, family):
    tok = families[family]
    convo = [U("Hi"), A("Hello.", reasoning_content="greet back"), U("How many zebras?"),
             A("Four.", reasoning_content=THOUGHT)]
    stats = new_stats()
    ds = prepare_conversations([{"id": "c", "messages": convo}], tok, stats=stats)
    assert ds["id"] == ["c#turn0", "c#turn1"] and stats["reasoning_turns"] == 2
    first, second = ([s for s in segments(tok, i, m)] for i, m in zip(ds["input_ids"], ds["loss_mask"]))
    assert len(first) == len(second) == 1 and "greet back" in first[0] and THOUGHT in second[0]
    # the second turn comes after the history the model saw: as the template renders it for generation
    history = tok.apply_chat_template(convo[:3], add_generation_prompt=True, tokenize=False)
    assert tok.decode(ds["input_ids"][1]) == history + EMITTED[family][1]
    assert "greet back" not in history  # the template blanked it there
    assert reasoning_loss_tokens(tok, ds["input_ids"][1], ds["loss_mask"][1], THOUGHT) >= 5
    stats = new_stats()  # --last-turn-only: that one sample, under the conversation's id
    ds = prepare_conversations([{"id": "c", "messages": convo}], tok, stats=stats, last_turn_only=True)
    assert ds["id"] == ["c"] and stats["reasoning_turns"] == 1
    assert tok.decode(ds["input_ids"][0]) == history + EMITTED[family][1]


def test_reasoning_only_tokens_enter_the_draft_vocabulary(families):
    tok = families["k25"]
    convs = [{"id": f"z{i}", "messages": ASK + [A("Four.", reasoning_content=f"{THOUGHT} Xylophonequark")]}
             for i in range(3)]
    rare = tok(" Xylophonequark", add_special_tokens=False)["input_ids"]
    trained = token_counts(prepare_conversations(convs, tok), len(tok))
    dropped = token_counts(prepare_conversations(convs, tok, reasoning="drop"), len(tok))
    assert all(trained[t] >= 3 for t in rare) and not any(dropped[t] for t in rare)
    assert trained.sum() > dropped.sum()


def test_a_template_that_drops_reasoning_with_no_block_to_put_it_in_is_refused(families, tmp_path, capsys):
    """A thinking template (it splits at `</think>`) that shows no block for the answer and opens none in its
    generation prompt: where the reasoning goes would be a guess, so the sample is refused by name, in one line."""
    tok = families["qwen3"]
    blind = QWEN3_TEMPLATE.replace("(loop.last or thought)", "false")
    assert blind != QWEN3_TEMPLATE
    convo = ASK + [A("Four.", reasoning_content=THOUGHT)]
    kw = {"template_kwargs": {"chat_template": blind}}
    with pytest.raises(ValueError, match=r"^sample s7: assistant message 1 has reasoning that the chat template "
                                         r"drops.*--reasoning drop"):
        prepare_conversations([{"id": "s7", "messages": convo}], tok, **kw)
    ds = prepare_conversations([{"id": "s7", "messages": convo}], tok, reasoning="drop", **kw)
    assert segments(tok, ds["input_ids"][0], ds["loss_mask"][0]) == ["Four.<|im_end|>"]
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "blind.jinja").write_text(blind)
    write_jsonl(tmp_path / "in.jsonl", [{"id": "s7", "messages": convo}])
    argv = ["prepare", "--tokenizer", str(tmp_path / "tok"), "--input", str(tmp_path / "in.jsonl"), "--output",
            str(tmp_path / "out"), "--chat-template", str(tmp_path / "blind.jinja")]
    capsys.readouterr()
    assert cli.main(argv) == 1
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line and not line.startswith("prepare: ")]
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'in.jsonl'}: sample s7: assistant message 1 has "
                                               "reasoning that the chat")
    assert cli.main(argv + ["--reasoning", "drop"]) == 0


def test_cli_records_the_policy_and_reads_the_servers_reasoning_key(tmp_path, families, capsys):
    tok_dir = tmp_path / "k25"
    families["k25"].save_pretrained(tok_dir)
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "a", "messages": ASK + [A("Four.", reasoning=THOUGHT)]},  # vLLM's newer field name
                      {"id": "b", "messages": ASK + [A("Four.", reasoning_content=THOUGHT)]},
                      {"id": "c", "messages": NON_THINKING[1]["messages"]}])
    out = {}
    for policy in ("train", "drop", "keep"):
        assert cli.main(["prepare", "--tokenizer", str(tok_dir), "--input", str(src), "--output",
                         str(tmp_path / policy), "--reasoning", policy]) == 0
        out[policy] = load_prepared(tmp_path / policy)
    ds, meta = out["train"]
    assert meta["options"]["reasoning"] == "train" and meta["counts"]["reasoning_turns"] == 2
    assert segments(families["k25"], ds["input_ids"][0], ds["loss_mask"][0]) == [EMITTED["k25"][1]]  # no newline
    assert ds["input_ids"][0] == ds["input_ids"][1]
    assert out["drop"][1]["options"]["reasoning"] == "drop" and out["drop"][1]["counts"]["reasoning_turns"] == 0
    assert out["keep"][1]["options"]["reasoning"] == "train"  # the earlier name of the policy
    assert out["keep"][0].to_dict() == ds.to_dict()
    assert "2 assistant turns trained with their reasoning" in capsys.readouterr().err


def test_kimis_tool_loop_keeps_the_reasoning_it_showed_the_model(families):
    """Kimi-K2.5 keeps reasoning while a tool loop runs and blanks it once an answer closes the loop: the final
    answer's sample starts from the history the model saw (the call's reasoning in it), then its own reasoning."""
    tok = families["k25"]
    convo = [U("Weather in Paris?"), A("", tool_calls=[CALL], reasoning_content="look it up"),
             {"role": "tool", "content": '{"sky": "sunny"}'}, A("Sunny.", reasoning_content="read the result")]
    stats = new_stats()
    ds = prepare_conversations([{"id": "loop", "messages": convo}], tok, stats=stats)
    assert ds["id"] == ["loop#turn0", "loop#turn1"] and stats["reasoning_turns"] == 2
    call, answer = (segments(tok, i, m) for i, m in zip(ds["input_ids"], ds["loss_mask"]))
    assert call == ['look it up</think><|tool_calls_section_begin|><|tool_call_begin|>get_weather'
                    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
                    '<|im_end|>']
    assert answer == ["read the result</think>Sunny.<|im_end|>"]
    seen = tok.apply_chat_template(convo[:3], add_generation_prompt=True, tokenize=False)
    assert "<think>look it up</think>" in seen  # the loop's reasoning, as the model saw it
    assert tok.decode(ds["input_ids"][1]) == seen + answer[0]
    assert "look it up" not in tok.apply_chat_template(convo, tokenize=False)  # what rendering whole would lose
    # --tool-calls drop: the call and its result leave the conversation; the answer's sample is all that is left
    stats = new_stats()
    ds = prepare_conversations([{"id": "loop", "messages": convo}], tok, stats=stats, tool_calls="drop")
    assert ds["id"] == ["loop"] and stats["reasoning_turns"] == 1
    assert tok.decode(ds["input_ids"][0]) == tok.apply_chat_template(convo[:1], add_generation_prompt=True,
                                                                     tokenize=False) + answer[0]


def test_a_thought_the_answer_repeats_is_not_taken_for_kept(families):
    tok = families["k25"]
    [(_, ids, mask, turns)] = render_samples(ASK + [A("Four.", reasoning_content="Four")], tok)
    assert turns == 1 and segments(tok, ids, mask) == ["Four</think>Four.<|im_end|>"]
