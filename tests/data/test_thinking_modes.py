"""The thinking mode is part of the drafter's contract (eagle3_hf/data/thinking_mode.py, reasoning.py): in each mode a
thinking template renders (Kimi-K2.5's `thinking`, Qwen3's `enable_thinking`, R1's one mode), a sample is the
server's generation prompt followed by exactly what the model emits in that mode, and only that carries loss; the
mode is found from the template, said in one line when the user gave none, and recorded with the data. Reasoning
under a template without thinking syntax is refused by file and sample unless the user chooses drop or inline."""

from __future__ import annotations

import json

import pytest

from eagle3_hf import cli
from eagle3_hf.data.conversations import write_jsonl
from eagle3_hf.data.prepare import new_stats, prepare_conversations, render_samples
from eagle3_hf.data.prepared_format import load_prepared
from eagle3_hf.data.thinking_mode import thinking_mode

from tests.helpers.chat_templates import CALL, A, U, family_tokenizer
from tests.helpers.thinking_templates import thinking_tokenizer

THOUGHT = "count the zebras twice"
ASK = [U("How many zebras?")]
SWITCH = {"k25": "thinking", "qwen3": "enable_thinking"}
# (family, template kwargs, what the model emits after the server's generation prompt in that mode)
MODES = {
    "k25-on": ("k25", {"thinking": True}, f"{THOUGHT}</think>Four.<|im_end|>"),
    "k25-off": ("k25", {"thinking": False}, "Four.<|im_end|>"),
    "k25-default": ("k25", {}, f"{THOUGHT}</think>Four.<|im_end|>"),
    "qwen3-on": ("qwen3", {"enable_thinking": True}, f"<think>\n{THOUGHT}\n</think>\n\nFour.<|im_end|>"),
    "qwen3-off": ("qwen3", {"enable_thinking": False}, "Four.<|im_end|>"),
    "r1": ("r1", {}, f"{THOUGHT}\n</think>\n\nFour.<｜end▁of▁sentence｜>"),
}


@pytest.fixture(scope="module")
def tokenizers(default_verifier_dir):
    out = {f: thinking_tokenizer(default_verifier_dir, f) for f in ("k25", "qwen3", "r1")}
    out["llama3"] = family_tokenizer(default_verifier_dir, "llama3")
    return out


def loss_text(tok, ids: list[int], mask: list[int]) -> list[str]:
    runs: list[list[int]] = [[]]
    for i, m in zip(ids, mask):
        if m:
            runs[-1].append(i)
        elif runs[-1]:
            runs.append([])
    return [tok.decode(r) for r in runs if r]


def assert_server_prompt_then_emitted(tok, ids, mask, prompt: str, emitted: str) -> None:
    """The sample is the served prompt + the emitted turn, and the loss is exactly on the tokens that start inside the
    emitted turn (its trailing newline aside): none of the prompt, nothing the server would not have the model emit."""
    text = tok.decode(ids)
    assert text.startswith(prompt) and text[len(prompt):].rstrip("\n") == emitted.rstrip("\n")
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids
    end = len(prompt) + len(emitted.rstrip("\n"))
    assert mask == [int(len(prompt) <= a < end) for a, _ in enc["offset_mapping"]]
    assert sum(mask) >= 3


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_trains_what_the_server_emits_after_its_prompt(tokenizers, mode):
    family, kw, emitted = MODES[mode]
    tok = tokenizers[family]
    notes = new_stats()
    [(_, ids, mask, turns)] = render_samples(ASK + [A("Four.", reasoning_content=THOUGHT)], tok, sample_id="s",
                                             template_kwargs=kw, notes=notes)
    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, **kw)  # what the server sends
    assert_server_prompt_then_emitted(tok, ids, mask, prompt, emitted)
    on = THOUGHT in emitted
    assert turns == int(on) and notes["reasoning_unshown"] == int(not on)
    assert ("zebras twice" in "".join(loss_text(tok, ids, mask))) == on  # under the loss iff the mode shows it
    assert (THOUGHT in tok.decode(ids)) == on  # off: not even as context (the server never shows it)


@pytest.mark.parametrize("mode", ["k25-on", "k25-off", "qwen3-on", "qwen3-off", "r1"])
def test_every_turn_follows_the_history_the_server_renders_in_that_mode(tokenizers, mode):
    family, kw, emitted = MODES[mode]
    tok = tokenizers[family]
    convo = [U("Hi"), A("Hello.", reasoning_content="greet back"), U("How many zebras?"),
             A("Four.", reasoning_content=THOUGHT)]
    ds = prepare_conversations([{"id": "c", "messages": convo}], tok, template_kwargs=kw, last_turn_only=True)
    history = tok.apply_chat_template(convo[:3], add_generation_prompt=True, tokenize=False, **kw)
    assert_server_prompt_then_emitted(tok, ds["input_ids"][0], ds["loss_mask"][0], history, emitted)
    assert "greet back" not in history  # each of these templates blanks earlier turns' reasoning


def test_kimi_tool_loop_with_thinking_off_trains_no_reasoning(tokenizers):
    tok = tokenizers["k25"]
    convo = [U("Weather in Paris?"), A("", tool_calls=[CALL], reasoning_content="look it up"),
             {"role": "tool", "content": '{"sky": "sunny"}'}, A("Sunny.", reasoning_content="read the result")]
    stats = new_stats()
    ds = prepare_conversations([{"id": "loop", "messages": convo}], tok, stats=stats,
                               template_kwargs={"thinking": False})
    assert ds["id"] == ["loop"] and stats["reasoning_turns"] == 0 and stats["reasoning_unshown"] == 2
    trained = "".join(loss_text(tok, ds["input_ids"][0], ds["loss_mask"][0]))
    assert "look it up" not in trained and "read the result" not in trained and "Sunny." in trained
    assert tok.decode(ds["input_ids"][0]) == tok.apply_chat_template(convo, tokenize=False, thinking=False)


@pytest.mark.parametrize("family, variable, default", [("k25", "thinking", True), ("qwen3", "enable_thinking", True),
                                                      ("r1", None, None), ("llama3", None, None)])
def test_the_switch_and_its_default_are_read_from_the_template(tokenizers, family, variable, default):
    mode = thinking_mode(tokenizers[family])
    assert (mode.variable, mode.value, mode.given) == (variable, default, False)
    if variable:
        assert thinking_mode(tokenizers[family], {variable: False}).value is False
        assert thinking_mode(tokenizers[family], {variable: False}).given
        line = mode.default_line()
        assert f"`{variable}` (default true)" in line and f'\'{{"{variable}": false}}\'' in line
    else:
        assert mode.default_line() is None
    # a template that defaults the switch off (Gemma-4 style `| default(false)`) is read as off
    if family == "qwen3":
        tok = tokenizers[family]
        default_off = tok.chat_template.replace("enable_thinking is defined and not enable_thinking",
                                                "not (enable_thinking | default(false))")
        assert default_off != tok.chat_template
        assert thinking_mode(tok, {"chat_template": default_off}).value is False


@pytest.mark.parametrize("given", [None, {"thinking": False}])
def test_prepare_says_and_records_the_mode(tmp_path, tokenizers, given, capsys):
    tok_dir = tmp_path / "k25"
    tokenizers["k25"].save_pretrained(tok_dir)
    write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "messages": ASK + [A("Four.", reasoning_content=THOUGHT)]}])
    extra = ["--chat-template-kwargs", json.dumps(given)] if given else []
    assert cli.main(["prepare", "--tokenizer", str(tok_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(tmp_path / "out"), *extra]) == 0
    err = capsys.readouterr().err
    ds, meta = load_prepared(tmp_path / "out")
    if given is None:
        assert meta["chat_template_kwargs"] == {"thinking": True}
        assert meta["thinking"] == {"variable": "thinking", "value": True, "given": False}
        said = [line for line in err.splitlines() if "switches thinking" in line]
        assert len(said) == 1 and "`thinking` (default true)" in said[0]
        assert meta["counts"]["reasoning_turns"] == 1
    else:
        assert meta["chat_template_kwargs"] == {"thinking": False} and meta["options"]["template_kwargs"] == given
        assert meta["thinking"] == {"variable": "thinking", "value": False, "given": True}
        assert "switches thinking" not in err
        assert meta["counts"]["reasoning_unshown"] == 1 and meta["counts"]["reasoning_turns"] == 0
        assert "1 assistant turns' reasoning not trained: thinking is off" in err
    with pytest.raises(SystemExit):  # not a JSON object: refused by argparse, naming the flag
        cli.main(["prepare", "--tokenizer", str(tok_dir), "--input", str(tmp_path / "in.jsonl"), "--output",
                  str(tmp_path / "bad"), "--chat-template-kwargs", "[1]"])
    assert "--chat-template-kwargs" in capsys.readouterr().err


def test_reasoning_with_nowhere_to_go_is_refused_by_file_and_sample(tmp_path, tokenizers, capsys):
    """Llama-3.1's template has no thinking syntax: reasoning data is refused in one line naming file and sample, and
    goes in only as the user chooses: dropped, or inline as `<think>…</think>` text."""
    tok = tokenizers["llama3"]
    convs = [{"id": "fine", "messages": ASK + [A("Four.")]},
             {"id": "r-7", "messages": ASK + [A("Four.", reasoning_content=THOUGHT)]}]
    with pytest.raises(ValueError, match=r"^sample r-7: assistant message 1 has reasoning, and the chat template has "
                                         r"no thinking syntax"):
        prepare_conversations(convs, tok)
    tok.save_pretrained(tmp_path / "tok")
    write_jsonl(tmp_path / "in.jsonl", convs)
    argv = ["prepare", "--tokenizer", str(tmp_path / "tok"), "--input", str(tmp_path / "in.jsonl")]
    capsys.readouterr()
    assert cli.main(argv + ["--output", str(tmp_path / "o1")]) == 1
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line and not line.startswith("prepare")]
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path / 'in.jsonl'}: sample r-7: assistant message 1")
    assert "--reasoning drop" in err[0] and "--reasoning inline" in err[0]
    assert cli.main(argv + ["--output", str(tmp_path / "drop"), "--reasoning", "drop"]) == 0
    ds, _ = load_prepared(tmp_path / "drop")
    assert not any("zebras" in t for i, m in zip(ds["input_ids"], ds["loss_mask"]) for t in loss_text(tok, i, m))
    assert cli.main(argv + ["--output", str(tmp_path / "inline"), "--reasoning", "inline"]) == 0
    ds, meta = load_prepared(tmp_path / "inline")
    assert meta["options"]["reasoning"] == "inline" and meta["thinking"] is None
    inlined = f"<think>\n{THOUGHT}\n</think>\n\nFour.<|eot_id|>"
    assert loss_text(tok, ds["input_ids"][1], ds["loss_mask"][1]) == [inlined]
    # inline is for templates without thinking syntax: a thinking template renders reasoning itself
    with pytest.raises(ValueError, match=r"^sample r-7: --reasoning inline .* use --reasoning train"):
        prepare_conversations(convs, tokenizers["k25"], reasoning="inline")


def kimi_like_verifier(tiny_verifier_dir, path):
    """The tiny verifier with Kimi-K2.5's switch (the k25 template) on its own vocabulary."""
    import shutil

    from transformers import AutoTokenizer

    from tests.helpers.thinking_templates import K25_TEMPLATE

    shutil.copytree(tiny_verifier_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = K25_TEMPLATE
    tok.save_pretrained(path)
    return path, tok


def test_the_mode_is_carried_from_the_data_to_the_drafter_and_its_serve_lines(tmp_path, tiny_verifier_dir):
    """prepare records the mode; extract carries it in the feature manifest; train writes it into the drafter's
    config; the card serves it (the path the tokenizer class takes: data/fingerprint.py)."""
    from eagle3_hf.publish.model_card import build_model_card

    verifier, _ = kimi_like_verifier(tiny_verifier_dir, tmp_path / "kimi-like")
    convs = [{"id": f"c{i}", "messages": [U(f"What is {i} + {i}?"), A(f"{2 * i}.", reasoning_content=f"add {i}")]}
             for i in range(6)]
    write_jsonl(tmp_path / "in.jsonl", convs)
    prepared, features = tmp_path / "prepared", tmp_path / "features"
    assert cli.main(["prepare", "--tokenizer", str(verifier), "--input", str(tmp_path / "in.jsonl"), "--output",
                     str(prepared), "--chat-template-kwargs", '{"thinking": false}']) == 0
    assert cli.main(["extract", "--verifier", str(verifier), "--data", str(prepared), "--output", str(features),
                     "--no-progress"]) == 0
    assert json.loads((features / "manifest.json").read_text())["chat_template_kwargs"] == {"thinking": False}
    assert cli.main(["vocab", "--data", str(prepared), "--draft-vocab-size", "64", "--output",
                     str(features / "vocab.safetensors")]) == 0
    assert cli.main(["train", "--verifier", str(verifier), "--features", str(features), "--output-dir",
                     str(tmp_path / "run"), "--max-seq-len", "64", "--max-steps", "1", "--per-device-train-batch-size",
                     "1", "--report-to", "none", "--disable-tqdm", "true", "--save-strategy", "no", "--eval-strategy",
                     "no"]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["verifier_chat_template_kwargs"] == {"thinking": False}
    assert """--default-chat-template-kwargs '{"thinking": false}'""" in str(build_model_card(tmp_path / "run"))


def test_regenerate_asks_in_the_mode_given(tmp_path):
    from tests.helpers.openai_stub import OpenAIStub

    write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "messages": [U(f"q{i}")]} for i in range(3)])
    for kwargs in ('{"thinking": false}', None):
        out = tmp_path / f"{bool(kwargs)}.jsonl"
        with OpenAIStub() as stub:
            assert cli.main(["regenerate", "--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--endpoint",
                             stub.url, "--model", "m", "--wait-for-server", "0",
                             *(["--chat-template-kwargs", kwargs] if kwargs else [])]) == 0
        assert len(stub.requests) == 3
        # as vLLM and SGLang take it per request; none sent when none is given (the server's default applies)
        assert all(r.get("chat_template_kwargs") == (json.loads(kwargs) if kwargs else None) for r in stub.requests)
        summary = json.loads(out.with_name(out.stem + ".summary.json").read_text())  # the mode asked in, recorded
        assert summary["chat_template_kwargs"] == (json.loads(kwargs) if kwargs else None)


@pytest.mark.parametrize("thinking", [False, True])
def test_regenerate_with_features_renders_and_records_the_mode(tmp_path, tiny_verifier_dir, thinking):
    """The in-process route: prompts rendered in the mode given, the samples cut in it, the mode recorded in the
    feature manifest (what train carries on) and the prepared meta."""
    import datasets

    verifier, tok = kimi_like_verifier(tiny_verifier_dir, tmp_path / "kimi-like")
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "messages": [U(f"What is {i}?")]} for i in range(2)])
    kwargs = {"thinking": thinking}
    assert cli.main(["regenerate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "c.jsonl"),
                     "--verifier", str(verifier), "--max-new-tokens", "4", "--features-out", str(tmp_path / "f"),
                     "--prepared-out", str(tmp_path / "p"), "--chat-template-kwargs", json.dumps(kwargs)]) == 0
    assert json.loads((tmp_path / "f" / "manifest.json").read_text())["chat_template_kwargs"] == kwargs
    assert json.loads((tmp_path / "p" / "eagle3_prepare.json").read_text())["chat_template_kwargs"] == kwargs
    ds = datasets.load_from_disk(str(tmp_path / "p"))
    for k, (ids, mask) in enumerate(zip(ds["input_ids"], ds["loss_mask"])):
        prompt = tok.apply_chat_template([U(f"What is {k}?")], add_generation_prompt=True, tokenize=False, **kwargs)
        assert prompt.endswith("<|im_middle|><think></think>" if not thinking else "<|im_middle|><think>")
        assert tok.decode(ids).startswith(prompt)  # the sample follows the prompt of that mode
        n = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert not any(mask[:n - 1]) and all(mask[n:])  # the answer and its end carry loss, the prompt none


def test_an_answer_generated_after_an_opened_block_keeps_its_reasoning_apart(tmp_path, tiny_verifier_dir, monkeypatch):
    """In process, the text generated after Kimi-K2.5's `<think>` is `REASONING</think>ANSWER`: regenerate splits it as
    the servers' reasoning parsers do, so the row renders as the template renders it and prepare trains it as
    emitted (without the split the answer's text would hold `</think>` and the history be wrong)."""
    from types import SimpleNamespace

    from eagle3_hf.data.regenerate_backends import TransformersBackend
    from eagle3_hf.data.thinking_mode import split_emitted

    kimi_prompt, r1_prompt = "<|im_middle|><think>", "<｜Assistant｜><think>\n"
    assert split_emitted(kimi_prompt, "look it up</think>Four.") == ("Four.", "look it up")
    assert split_emitted(r1_prompt, "look it up\n</think>\n\nFour.") == ("\n\nFour.", "look it up")
    assert split_emitted("<|im_middle|><think></think>", "a</think>b") == ("a</think>b", None)  # closed: all answer
    assert split_emitted(kimi_prompt, "cut before the close") == ("cut before the close", None)

    verifier, tok = kimi_like_verifier(tiny_verifier_dir, tmp_path / "kimi-like")
    backend = TransformersBackend(str(verifier), device="cpu", max_new_tokens=8)
    emitted = tok("look it up</think>Four.", add_special_tokens=False)["input_ids"]
    fake = SimpleNamespace(generate=lambda ids, extra: [SimpleNamespace(answer=emitted, finish_reason="stop")])
    monkeypatch.setattr(backend, "generator", lambda *a: fake)
    [(answer, reasoning, _, finish, _)] = backend.generate([(ASK, None)])
    assert (answer, reasoning, finish) == ("Four.", "look it up", "stop")
    [(_, ids, mask, turns)] = render_samples(ASK + [A(answer, reasoning_content=reasoning)], tok)
    assert turns == 1 and loss_text(tok, ids, mask) == ["look it up</think>Four.<|im_end|>"]
