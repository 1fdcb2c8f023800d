"""Thinking verifiers trained on their thinking: each assistant turn rendered as the model emitted it.

Thinking models' chat templates show reasoning only where the model needs it at inference, not as it was
emitted: Kimi-K2.5's renders every finished assistant turn, the last one included, as `<think></think>` +
answer and opens `<think>` in its generation prompt; Qwen3's keeps the reasoning only after the last user query;
DeepSeek-R1's keeps only the text after `</think>` and opens the block in its generation prompt. Rendered as is, a
conversation with reasoning trains the drafter on `<think></think>answer` and never on the reasoning, most of what
a thinking model serves, and tokens found only in reasoning never enter the draft vocabulary.

`prepare --reasoning train` (the default) keeps it. Reasoning comes as `reasoning_content` (or `reasoning`) on
assistant messages, what the servers' reasoning parsers return, or inline as a leading `<think>…</think>` in
the content when the template is a thinking one. A conversation is rendered, in the thinking mode given as
chat-template kwargs (thinking_mode.py), in order of preference:

0. thinking off (the generation prompt closes an empty block: Kimi `thinking=false`, Qwen3 `enable_thinking=false`):
   the model emits no reasoning in that mode, so none is trained; the turns are rendered as the template renders
   them without it, and counted (`prepare` says how many in one line);
1. by the template itself, when the trained turns' reasoning is in its rendering (a template that keeps it): the
   sample `prepare` always wrote;
2. else one sample per turn (`ID#turnK`, as `--split-turns`): the history as the template renders it at
   inference, then the turn as the model emitted it after the generation prompt. The template's own rendering of
   that turn when it keeps its reasoning (Qwen3's latest turn); else the reasoning is put where the template shows
   the block: inside the empty `<think></think>` it renders for the answer (Kimi-K2 without an opened prompt),
   after the `<think>` its generation prompt opens, closed as the template closes it (`</think>` right after the
   reasoning for Kimi-K2.5, whose answers render after an empty block; `\\n</think>\\n\\n` after `<think>\\n` for R1);
3. else refused by sample: the template drops the reasoning and shows no block to put it in, so any place
   chosen here would be a guess and train the drafter on text the model never emits. `--reasoning drop`
   (train on the answers, as the template renders them) is then the user's explicit choice.

A template with no thinking syntax at all (Llama-3.1: no `<think>`, no `reasoning_content`) and data with
reasoning (a third-party reasoning set) is refused by sample too: the model was never taught to emit it.
`--reasoning drop` trains on the answers; `--reasoning inline` trains on the reasoning as `<think>…</think>` text
before each answer, the user's explicit choice (a model fine-tuned to emit it).

Data without reasoning never enters this path: its samples are byte for byte what they were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .chat_render import NoLossTokens, apply_policies, assistant_spans, chat_template_source, render_chat, turn_end
from .thinking_mode import prompt_closes_block

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OPEN, CLOSE = "<think>", "</think>"
POLICIES = ("train", "drop", "inline")


def policy(name: str) -> str:
    """`train`, `drop` or `inline`; `keep` (the earlier name of `train`) is read as `train`."""
    name = "train" if name == "keep" else name
    if name not in POLICIES:
        raise ValueError(f"--reasoning must be train, drop or inline, got {name!r}")
    return name


@dataclass(frozen=True)
class Rendered:
    """One sample's text and loss spans; `reasoning_turns`: trained turns whose reasoning is in the spans;
    `unshown_turns`: turns whose reasoning the thinking mode does not emit (thinking off), so not trained."""

    sample_id: str
    text: str
    spans: list[tuple[int, int]]
    reasoning_turns: int
    unshown_turns: int = 0


def thinking_template(source: str) -> bool:
    """A template that handles reasoning itself (reads `reasoning_content` or splits at `</think>`)."""
    return "reasoning_content" in source or CLOSE in source


def split_inline(messages: list[dict]) -> list[dict]:
    """An assistant content that opens with `<think>…</think>` becomes `reasoning_content` + the rest, as a
    server's reasoning parser splits it (for thinking templates, which would otherwise blank or garble it)."""
    out = []
    for msg in messages:
        text = msg.get("content") or ""
        if msg["role"] == "assistant" and not msg.get("reasoning_content") and text.lstrip().startswith(OPEN) \
                and CLOSE in text:
            inner, _, rest = text.lstrip()[len(OPEN):].partition(CLOSE)
            msg = dict(msg, content=rest, reasoning_content=inner)
        out.append(msg)
    return out


def _loss_turns(messages: list[dict], last_turn_only: bool) -> list[int]:
    first_ask = next((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), len(messages))
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > first_ask]
    return turns[-1:] if last_turn_only else turns


def _thought(msg: dict) -> str:
    return (msg.get("reasoning_content") or "") if msg["role"] == "assistant" else ""


def _kept(text: str, spans: list[tuple[int, int]], thoughts: list[str], answers: list[str]) -> bool:
    """Every thought is in the trained text, more often than the answers alone hold it (a thought that is a piece of
    an answer does not count as kept)."""
    trained = "\0".join(text[a:b] for a, b in spans)
    said = "\0".join(answers)
    return all(trained.count(t.strip()) > said.count(t.strip()) for t in thoughts)


def render_reasoning(messages: list[dict], tokenizer: PreTrainedTokenizerBase, *, sample_id: str,
                     tools: list | None = None, last_turn_only: bool = False, tool_calls: str = "keep",
                     template_kwargs: dict | None = None) -> list[Rendered] | None:
    """The samples of one conversation with their reasoning in the loss (module docstring), or None when the
    trained turns carry no reasoning (the caller renders it as it always did)."""
    source = chat_template_source(tokenizer, tools, template_kwargs)
    if thinking_template(source):
        messages = split_inline(messages)
    turns = _loss_turns(messages, last_turn_only)
    thoughts = [_thought(messages[i]) for i in turns]
    if not any(t.strip() for t in thoughts):
        return None
    if not thinking_template(source):
        first = next(i for i, t in zip(turns, thoughts) if t.strip())
        raise ValueError(
            f"sample {sample_id}: assistant message {first} has reasoning, and the chat template has no thinking "
            f"syntax to render it in (no {OPEN} block, no reasoning_content): pass --reasoning drop to train on the "
            f"answers only, or --reasoning inline to train on it as {OPEN}…{CLOSE} text before the answer")
    if prompt_closes_block(tokenizer, template_kwargs, tools):  # 0. thinking off: the model emits none
        policed = apply_policies(messages, "drop", tool_calls, True)
        text, spans = assistant_spans(policed, tokenizer, tools=tools, last_turn_only=last_turn_only,
                                      template_kwargs=template_kwargs, sample_id=sample_id)
        return [Rendered(sample_id, text, spans, 0, sum(1 for t in thoughts if t.strip()))]
    # a thinking template gets the reasoning as the field a server passes back (it decides what history shows);
    # any other keeps it inline, as prepare always rendered it
    renders = thinking_template(source)
    policed = apply_policies(messages, "keep", tool_calls, renders)
    try:  # 1. the template's own rendering, when it keeps every trained turn's reasoning
        text, spans = assistant_spans(policed, tokenizer, tools=tools, last_turn_only=last_turn_only,
                                      template_kwargs=template_kwargs, sample_id=sample_id)
        if _kept(text, spans, [t for t in thoughts if t.strip()], [messages[i].get("content") or "" for i in turns]):
            return [Rendered(sample_id, text, spans, sum(1 for t in thoughts if t.strip()))]
    except NoLossTokens:
        raise
    except ValueError:  # it rewrites history: one sample per turn below
        pass
    kept = [i for i in turns if apply_policies(messages[i:i + 1], "keep", tool_calls, renders)]  # not dropped
    out = []
    for i in kept:  # 2. each turn after the history it was generated from
        k = sum(1 for m in messages[:i] if m["role"] == "assistant")
        unit = sample_id if len(kept) == 1 else f"{sample_id}#turn{k}"
        upto = apply_policies(messages[: i + 1], "keep", tool_calls, renders)
        out.append(_one_turn(unit, messages[: i + 1], upto, tokenizer, tool_calls, renders, tools, template_kwargs))
    if not out:
        raise NoLossTokens("no assistant turn")
    return out


def _one_turn(unit: str, messages: list[dict], policed: list[dict], tokenizer: PreTrainedTokenizerBase,
              tool_calls: str, renders: bool, tools: list | None, template_kwargs: dict | None) -> Rendered:
    """`messages` ends with the turn to train; `policed` is it as the template is given it."""
    thought = _thought(messages[-1])
    try:
        text, spans = assistant_spans(policed, tokenizer, tools=tools, last_turn_only=True,
                                      template_kwargs=template_kwargs, sample_id=unit)
        if not thought.strip() or _kept(text, spans, [thought], [messages[-1].get("content") or ""]):
            return Rendered(unit, text, spans, int(bool(thought.strip())))
    except NoLossTokens:
        raise
    except ValueError:
        if not thought.strip():
            raise
    answer = apply_policies(messages[-1:], "drop", tool_calls, renders)
    if not answer:  # a turn that was only a tool call, its calls dropped
        raise NoLossTokens("no assistant turn")
    history = render_chat(tokenizer, policed[:-1], False, tools, template_kwargs or {})
    prompt = render_chat(tokenizer, policed[:-1], True, tools, template_kwargs or {})
    blank = render_chat(tokenizer, policed[:-1] + answer, False, tools, template_kwargs or {})
    tail, body = _turn(history, prompt, blank)
    return _emitted(unit, len(messages) - 1, prompt, tail, body, thought)


def _turn(history: str, prompt: str, blank: str) -> tuple[str, str]:
    """(tail, body): what the generation prompt holds beyond the turn's header as rendered (R1's `<think>\\n`), and
    the turn after that header as the template renders it (without its reasoning) at the end of `blank`. Found
    after the last header in `blank`, for the earlier turns may render otherwise once it follows (Kimi's tool
    loop: reasoning kept while the loop runs, blanked once an answer closes it)."""
    if prompt.startswith(history) and len(prompt) > len(history):
        header = prompt[len(history):]
        opened = header.rfind(OPEN)
        if opened >= 0 and not header[opened + len(OPEN):].strip(" \n"):
            header = header[:opened]
        at = blank.rfind(header) if header else -1
        if at >= 0:
            return prompt[len(history) + len(header):], blank[at + len(header):]
    k = next((j for j, (a, b) in enumerate(zip(prompt, blank)) if a != b), min(len(prompt), len(blank)))
    return prompt[k:], blank[k:]


def _emitted(unit: str, index: int, prompt: str, tail: str, body: str, thought: str) -> Rendered:
    """prompt + the turn as emitted, from the turn as the template renders it without its reasoning (`body`)."""
    o = body.find(OPEN)
    c = body.find(CLOSE, o + len(OPEN)) if o >= 0 else -1
    if not tail and o >= 0 and c >= 0 and not body[:o].strip() and not body[o + len(OPEN):c].strip():
        inner = body[o + len(OPEN):c]  # an empty block rendered for the answer (Kimi): the reasoning goes in it
        lead, trail = inner[: len(inner) // 2], inner[len(inner) // 2:]
        before, after = body[: o + len(OPEN)] + lead, trail + body[c:]
        thought = thought.lstrip("\n") if lead else thought
        thought = thought.rstrip("\n") if trail else thought
    elif tail.rstrip(" \n").endswith(OPEN) and o >= 0 and c >= 0 and not body[:o].strip() \
            and not body[o + len(OPEN):c].strip():
        # the generation prompt opened it and the answer renders after an empty block (Kimi-K2.5, thinking on): the
        # model goes on inside the prompt's block, closes it as the template does, then answers
        ws, inner = tail[tail.rfind(OPEN) + len(OPEN):], body[o + len(OPEN):c]
        trail = inner[len(inner) // 2:]
        before, after = "", trail + body[c:]
        thought = thought.lstrip("\n") if ws else thought
        thought = thought.rstrip("\n") if trail else thought
    elif tail.rstrip(" \n").endswith(OPEN) and CLOSE not in body:  # the generation prompt opened it (R1)
        ws = tail[tail.rfind(OPEN) + len(OPEN):]
        before, after = "", ws + CLOSE + ("" if body[:1].isspace() else ws * 2) + body
        thought = thought.strip("\n") if ws else thought
    else:
        raise ValueError(
            f"sample {unit}: assistant message {index} has reasoning that the chat template drops, and it shows no "
            f"{OPEN}{CLOSE} block for the answer nor opens one in its generation prompt to put it in; pass "
            f"--reasoning drop to train on the answers only, or a --chat-template that renders reasoning_content")
    text = prompt + before + thought + after
    start = len(prompt)
    return Rendered(unit, text, [(start, turn_end(text))] if turn_end(text) > start else [], 1)
