"""Conversation reading and loss masks: the masked tokens, decoded, must be exactly the assistant's text
plus its end-of-turn token, for ChatML (the real SmolLM2 template), Llama-3 and DeepSeek-V3/Kimi-style
templates written out as the models ship them (tests/helpers/chat_templates.py)."""

from __future__ import annotations

import json

import datasets
import pytest

from eagle3_hf import cli
from eagle3_hf.constants import PREPARE_META
from eagle3_hf.data.conversations import load_conversations, read_jsonl_conversations, write_jsonl
from eagle3_hf.data.prepare import new_stats, prepare_conversations, render_with_mask
from eagle3_hf.data.prepared_format import load_prepared

from tests.helpers.chat_templates import DEEPSEEK_V3_TEMPLATE, family_tokenizer


@pytest.fixture(scope="module")
def llama3(default_verifier_dir):
    return family_tokenizer(default_verifier_dir, "llama3")


@pytest.fixture(scope="module")
def deepseek(default_verifier_dir):
    return family_tokenizer(default_verifier_dir, "deepseek")


@pytest.fixture(scope="module")
def kimi(default_verifier_dir):
    return family_tokenizer(default_verifier_dir, "kimi")


def segments(tok, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded runs of consecutive loss tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


CHAT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]


def test_chatml_multi_turn(tokenizer):
    ids, mask = render_with_mask(CHAT, tokenizer)
    assert ids == tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    assert segments(tokenizer, ids, mask) == ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"]
    # the newline after <|im_end|> and the header are not trained on
    text = tokenizer.convert_ids_to_tokens(ids)
    last_end = max(i for i, t in enumerate(text) if t == "<|im_end|>")
    assert mask[last_end] == 1 and mask[last_end + 1] == 0 and len(ids) == last_end + 2


def test_greeting_before_any_user_is_context(tokenizer):
    convo = [{"role": "assistant", "content": "Welcome!"}] + CHAT[:2]
    ids, mask = render_with_mask(convo, tokenizer)
    assert segments(tokenizer, ids, mask) == ["2+2 is 4.<|im_end|>"] and "Welcome!" in tokenizer.decode(ids)


def test_chatml_last_turn_only_and_trailing_user(tokenizer):
    convo = CHAT + [{"role": "user", "content": "unanswered"}]
    ids, mask = render_with_mask(convo, tokenizer, last_turn_only=True)
    assert segments(tokenizer, ids, mask) == ["It is 6.<|im_end|>"]
    assert "unanswered" not in tokenizer.decode(ids)  # nothing after the last assistant turn is kept


def test_llama3(llama3):
    convo = [{"role": "system", "content": "Be brief."}] + CHAT
    ids, mask = render_with_mask(convo, llama3)
    assert segments(llama3, ids, mask) == ["2+2 is 4.<|eot_id|>", "It is 6.<|eot_id|>"]
    assert ids[0] == llama3.bos_token_id and ids.count(llama3.bos_token_id) == 1 and mask[0] == 0


def test_deepseek_multi_turn_and_tool_calls(deepseek):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    convo = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"sky": "sunny"}'},
        {"role": "assistant", "content": "It is sunny in Paris."},
    ]
    ids, mask = render_with_mask(convo, deepseek)
    assert segments(deepseek, ids, mask) == [
        "Hello!<｜end▁of▁sentence｜>",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Paris"}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
        "It is sunny in Paris.<｜end▁of▁sentence｜>",
    ]
    assert "sunny\"}" in deepseek.decode(ids)  # the tool output is context, not loss
    ids, mask = render_with_mask(convo, deepseek, tool_calls="drop")
    assert segments(deepseek, ids, mask) == ["Hello!<｜end▁of▁sentence｜>",
                                             "It is sunny in Paris.<｜end▁of▁sentence｜>"]
    assert "get_weather" not in deepseek.decode(ids) and "sky" not in deepseek.decode(ids)


def test_reasoning_inline_for_chatml(tokenizer):
    convo = [{"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4.", "reasoning_content": "add two and two"}]
    with pytest.raises(ValueError, match=r"^sample c3: assistant message 1 has reasoning, and the chat template has "
                                         r"no thinking syntax .*--reasoning drop .* or --reasoning inline"):
        render_with_mask(convo, tokenizer, reasoning="keep", sample_id="c3")  # never inlined unasked
    ids, mask = render_with_mask(convo, tokenizer, reasoning="inline")
    assert segments(tokenizer, ids, mask) == ["<think>\nadd two and two\n</think>\n\n4.<|im_end|>"]
    ids, mask = render_with_mask(convo, tokenizer, reasoning="drop")
    assert segments(tokenizer, ids, mask) == ["4.<|im_end|>"]
    inline = [convo[0], {"role": "assistant", "content": "<think>hmm</think>\n\n4."}]
    ids, mask = render_with_mask(inline, tokenizer, reasoning="drop")
    assert segments(tokenizer, ids, mask) == ["4.<|im_end|>"]


def test_reasoning_rendered_by_template(kimi):
    convo = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
             {"role": "user", "content": "2+2?"},
             {"role": "assistant", "content": "4.", "reasoning_content": "add"}]
    ids, mask = render_with_mask(convo, kimi, last_turn_only=True)
    assert segments(kimi, ids, mask) == ["<think>add</think>4.<|im_end|>"]
    with pytest.raises(ValueError, match=r"sample conv-7: the template drops its earlier turns' reasoning: it makes "
                                         r"2 samples, one per turn"):
        render_with_mask(convo, kimi, sample_id="conv-7")  # history reasoning is dropped by the template
    # prepare trains every turn's reasoning: one sample per turn, each after the history the template renders
    ds = prepare_conversations([{"id": "k", "messages": convo}], kimi)
    assert ds["id"] == ["k#turn0", "k#turn1"]
    assert [segments(kimi, i, m) for i, m in zip(ds["input_ids"], ds["loss_mask"])] == [
        ["<think>greet</think>Hello.<|im_end|>"], ["<think>add</think>4.<|im_end|>"]]
    ids, mask = render_with_mask(convo, kimi, reasoning="drop")
    assert segments(kimi, ids, mask) == ["<think></think>Hello.<|im_end|>", "<think></think>4.<|im_end|>"]
    # one sample per turn: every turn keeps its reasoning, rendered as the template renders the latest turn
    ds = prepare_conversations([{"id": "k", "messages": convo + [{"role": "user", "content": "bye"}]}], kimi,
                               split_turns=True)
    assert ds["id"] == ["k#turn0", "k#turn1"]
    assert [segments(kimi, i, m) for i, m in zip(ds["input_ids"], ds["loss_mask"])] == [
        ["<think>greet</think>Hello.<|im_end|>"], ["<think>add</think>4.<|im_end|>"]]


def test_template_breaking_prefix_is_refused(tokenizer, deepseek):
    r1 = DEEPSEEK_V3_TEMPLATE.replace("{{'<｜Assistant｜>'}}{% endif %}", "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    assert r1 != DEEPSEEK_V3_TEMPLATE
    with pytest.raises(ValueError, match="sample s1: assistant message 1: .*generation prompt is not a prefix"):
        render_with_mask(CHAT[:2], deepseek, template_kwargs={"chat_template": r1}, sample_id="s1")


def test_prepare_counts_overlong_and_skips(tokenizer):
    convs = [{"id": "a", "messages": CHAT}, {"id": "b", "messages": [{"role": "user", "content": "no answer"}]},
             {"id": "c", "messages": CHAT[:2]}]
    full = len(render_with_mask(CHAT, tokenizer)[0])
    short = len(render_with_mask(CHAT[:2], tokenizer)[0])
    stats = new_stats()
    ds = prepare_conversations(convs, tokenizer, max_seq_len=short, overlong="truncate", stats=stats)
    assert ds["id"] == ["a", "c"] and [len(x) for x in ds["input_ids"]] == [short, short]
    assert stats["truncated"] == 1 and dict(stats["skipped"]) == {"no assistant turn": 1}
    assert ds.features["input_ids"].feature.dtype == "int32" and ds.features["loss_mask"].feature.dtype == "int8"
    assert stats["tokens"] == 2 * short and stats["loss_tokens"] == sum(map(sum, ds["loss_mask"]))
    stats = new_stats()
    ds = prepare_conversations(convs, tokenizer, max_seq_len=short, overlong="skip", stats=stats)
    assert ds["id"] == ["c"] and stats["skipped"][f"longer than max_seq_len {short}"] == 1
    with pytest.raises(ValueError, match=f"sample a: {full} tokens > max_seq_len {short}"):
        prepare_conversations(convs, tokenizer, max_seq_len=short, overlong="error")
    stats = new_stats()  # truncated before any assistant token: nothing to learn, skipped and counted
    ds = prepare_conversations(convs[:1], tokenizer, max_seq_len=5, stats=stats)
    assert len(ds) == 0 and stats["skipped"]["no loss tokens within max_seq_len"] == 1


def test_reading_formats_and_errors(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"id": "sg", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                       {"from": "gpt", "value": "A"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Q2"}]},
                      {"role": "assistant", "content": None, "reasoning_content": "r",
                       "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]}]},
    ]
    write_jsonl(path, rows)
    convs = read_jsonl_conversations(path)
    assert convs[0] == {"id": "sg", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                                                 {"role": "assistant", "content": "A"}]}
    assert convs[1]["id"] == "row-1" and convs[1]["messages"][0]["content"] == "Q2"
    assert convs[1]["messages"][1] == {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}

    bad = tmp_path / "bad.jsonl"
    cases = [
        ('{"messages": [{"role": "user", "content": "x"}]}\n\n{oops\n', r"bad\.jsonl:3: invalid JSON"),
        ('{"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]}\n',
         r"bad\.jsonl:1: message 1: unknown from 'robot'"),
        ('{"text": "hello"}\n', r"bad\.jsonl:1: no 'messages' \(OpenAI\) or 'conversations'"),
        ('{"messages": [{"role": "user", "content": 5}]}\n', r"bad\.jsonl:1: message 0: content must be a string"),
        ('{"id": 1, "messages": [{"role": "user", "content": "a"}]}\n' * 2, r"duplicate id '1'"),
    ]
    for text, pattern in cases:
        bad.write_text(text)
        with pytest.raises(ValueError, match=pattern):
            read_jsonl_conversations(bad)

    # a datasets dataset saved to disk, OpenAI columns (absent fields arrive as None and stay absent)
    ds = datasets.Dataset.from_list([{"id": "d0", "messages": [{"role": "user", "content": "Q", "name": None},
                                                               {"role": "assistant", "content": "A", "name": None}]}])
    ds.save_to_disk(str(tmp_path / "ds"))
    assert load_conversations(str(tmp_path / "ds")) == [
        {"id": "d0", "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}]


def test_cli_prepare(tmp_path, tokenizer, capsys):
    from eagle3_hf.data.fingerprint import tokenizer_fingerprint

    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": f"c{i}", "messages": CHAT} for i in range(3)]
                + [{"id": "lonely", "messages": [{"role": "user", "content": "hi"}]}])
    out = tmp_path / "prepared"
    argv = ["prepare", "--tokenizer", "smollm2-135m-instruct", "--input", str(src), "--output", str(out),
            "--max-seq-len", "40", "--limit", "4"]
    assert cli.main(argv) == 0
    ds, meta = load_prepared(out)
    assert ds["id"] == ["c0", "c1", "c2"] and all(len(x) == 40 for x in ds["input_ids"])
    c = meta["counts"]
    assert (c["input"], c["samples"], c["truncated"], c["skipped"]) == (4, 3, 3, {"no assistant turn": 1})
    assert c["loss_tokens"] == sum(map(sum, ds["loss_mask"])) > 0
    assert meta["tokenizer"] == "smollm2-135m-instruct"
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer)
    assert len(meta["chat_template_sha256"]) == 64
    err = capsys.readouterr().err
    assert "truncated 3 samples" in err and "skipped 1 samples: no assistant turn" in err
    assert cli.main(argv) == 0  # re-running replaces the earlier output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    assert cli.main(argv[:-5] + [str(tmp_path / "other")]) == 1
    assert "not a prepare output" in capsys.readouterr().err
    assert json.loads((out / PREPARE_META).read_text())["counts"]["samples"] == 3


@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory, default_verifier_dir):
    """The SmolLM2 tokenizer saved without a chat template, as a base model ships."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_verifier_dir)
    tok.chat_template = None
    path = tmp_path_factory.mktemp("base_tokenizer")
    tok.save_pretrained(path)
    return path


def test_chat_template_file_or_name_supplies_and_overrides_the_template(tmp_path, base_tokenizer_dir, tokenizer,
                                                                       capsys):
    import hashlib

    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "c0", "messages": CHAT}])
    argv = ["prepare", "--tokenizer", str(base_tokenizer_dir), "--input", str(src), "--output"]
    assert cli.main(argv + [str(tmp_path / "none")]) == 1
    assert "no chat template" in capsys.readouterr().err

    template = ("{% for m in messages %}{{ '### ' + m['role'] + ':\\n' + m['content'] + '<|endoftext|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}")
    template_file = tmp_path / "plain.jinja"
    template_file.write_text(template)
    assert cli.main(argv + [str(tmp_path / "file"), "--chat-template", str(template_file)]) == 0
    ds, meta = load_prepared(tmp_path / "file")
    assert meta["chat_template_sha256"] == hashlib.sha256(template.encode()).hexdigest()
    assert meta["options"]["chat_template"] == str(template_file)
    assert tokenizer.decode(ds["input_ids"][0]).startswith("### user:\nWhat is 2+2?<|endoftext|>### assistant:\n")
    assert segments(tokenizer, ds["input_ids"][0], ds["loss_mask"][0]) == ["2+2 is 4.<|endoftext|>",
                                                                            "It is 6.<|endoftext|>"]

    # a named (built-in) template, and an override of a tokenizer's own template, change what is rendered
    assert cli.main(argv + [str(tmp_path / "named"), "--chat-template", "chatml"]) == 0
    named, named_meta = load_prepared(tmp_path / "named")
    assert segments(tokenizer, named["input_ids"][0], named["loss_mask"][0]) == ["2+2 is 4.<|im_end|>",
                                                                                 "It is 6.<|im_end|>"]
    assert named_meta["chat_template_sha256"] != meta["chat_template_sha256"]
    own = ["prepare", "--tokenizer", "smollm2-135m-instruct", "--input", str(src), "--output"]
    assert cli.main(own + [str(tmp_path / "own")]) == 0
    assert cli.main(own + [str(tmp_path / "over"), "--chat-template", str(template_file)]) == 0
    over, own_ds = load_prepared(tmp_path / "over")[0], load_prepared(tmp_path / "own")[0]
    assert over["input_ids"] == ds["input_ids"] != own_ds["input_ids"]
    capsys.readouterr()
    assert cli.main(argv + [str(tmp_path / "bad"), "--chat-template", "nonesuch"]) == 1
    assert "error: --chat-template nonesuch: no such file" in capsys.readouterr().err


def test_text_mode_puts_loss_on_the_completion_only(tmp_path, base_tokenizer_dir, tokenizer, capsys):
    src = tmp_path / "text.jsonl"
    write_jsonl(src, [{"id": "p0", "prompt": "The capital of France is", "completion": " Paris, on the Seine."},
                      {"id": "t0", "text": "Once upon a time there was a fox."},
                      {"id": "e0", "prompt": "nothing follows", "completion": ""}])
    out = tmp_path / "prepared"
    assert cli.main(["prepare", "--tokenizer", str(base_tokenizer_dir), "--input", str(src), "--output", str(out),
                     "--text"]) == 0
    ds, meta = load_prepared(out)
    assert ds["id"] == ["p0", "t0"] and meta["counts"]["skipped"] == {"empty completion": 1}
    assert meta["chat_template_sha256"] is None and meta["options"]["text"] is True
    ids, mask = ds["input_ids"][0], ds["loss_mask"][0]
    assert segments(tokenizer, ids, mask) == [" Paris, on the Seine."]
    assert tokenizer.decode(ids) == "The capital of France is Paris, on the Seine."
    assert segments(tokenizer, ds["input_ids"][1], ds["loss_mask"][1]) == ["Once upon a time there was a fox."]

    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"id": "x", "messages": CHAT}])
    capsys.readouterr()
    assert cli.main(["prepare", "--tokenizer", str(base_tokenizer_dir), "--input", str(bad), "--output",
                     str(tmp_path / "x"), "--text"]) == 1
    assert "bad.jsonl:1: plain-text mode needs a string 'completion'" in capsys.readouterr().err
