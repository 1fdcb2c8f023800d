"""Render a conversation with the verifier's chat template and find the spans that carry loss (prepare.py's rule,
shared by `prepare`, reasoning.py and `regenerate --features-out`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_THINK_RE = re.compile(r"<think>.*?</think>\s*", re.S)


class NoLossTokens(ValueError):
    """A sample with nothing to learn from (no assistant turn); counted and skipped, not an error."""


def chat_template_source(tokenizer: PreTrainedTokenizerBase, tools: list | None = None,
                         template_kwargs: dict | None = None) -> str:
    """The template text actually used (a `chat_template` in template_kwargs overrides the tokenizer's)."""
    try:
        return tokenizer.get_chat_template((template_kwargs or {}).get("chat_template"), tools)
    except ValueError as e:
        name = getattr(tokenizer, "name_or_path", "tokenizer")
        raise ValueError(f"{name}: no chat template ({e})") from None


def apply_policies(messages: list[dict], reasoning: str = "keep", tool_calls: str = "keep",
                   renders_reasoning: bool = False) -> list[dict]:
    """Keep or drop reasoning and tool calls. Kept reasoning goes to `reasoning_content` when the
    template renders that field, else inline as `<think>…</think>` (what the model actually emitted)."""
    if reasoning not in ("keep", "drop") or tool_calls not in ("keep", "drop"):
        raise ValueError(f"reasoning/tool_calls must be 'keep' or 'drop', got {reasoning!r}/{tool_calls!r}")
    out = []
    for msg in messages:
        msg = dict(msg)
        if tool_calls == "drop" and msg["role"] == "tool":
            continue
        if msg["role"] == "assistant":
            thought = msg.pop("reasoning_content", None)
            if reasoning == "drop":
                msg["content"] = _THINK_RE.sub("", msg["content"])
            elif thought:
                if renders_reasoning:
                    msg["reasoning_content"] = thought
                else:
                    msg["content"] = f"<think>\n{thought}\n</think>\n\n{msg['content']}"
            if tool_calls == "drop":
                had_calls = msg.pop("tool_calls", None)
                if had_calls and not msg["content"].strip():
                    continue  # the turn was only a tool call
        out.append(msg)
    return out


def turn_end(rendered_turn: str) -> int:
    """Where an assistant turn's loss ends in its rendered text: before the template's trailing whitespace (the
    end token, e.g. ChatML's `<|im_end|>`, carries loss; the newline after it does not). The one rule, shared by
    `prepare` and `regenerate --features-out`."""
    return len(rendered_turn.rstrip())


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool, tools: list | None,
            template_kwargs: dict) -> str:
    return cast(str, tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                                   tokenize=False, **template_kwargs))  # tokenize=False: the text


def assistant_spans(messages: list[dict], tokenizer: PreTrainedTokenizerBase, *, tools: list | None = None,
                    last_turn_only: bool = False, template_kwargs: dict | None = None,
                    sample_id: str = "sample") -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the character spans [start, end) that carry loss."""
    kw = template_kwargs or {}
    # an assistant message before any user/tool message answers nothing (a canned greeting): context only
    first_ask = next((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), len(messages))
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > first_ask]
    if not turns:
        raise NoLossTokens("no assistant turn")
    messages = messages[: turns[-1] + 1]  # trailing user turns carry no loss
    if last_turn_only:
        turns = turns[-1:]
    text = render_chat(tokenizer, messages, False, tools, kw)
    spans = []
    for i in turns:
        prompt = render_chat(tokenizer, messages[:i], True, tools, kw)
        upto = render_chat(tokenizer, messages[: i + 1], False, tools, kw)
        if not upto.startswith(prompt):
            raise ValueError(
                f"sample {sample_id}: assistant message {i}: the chat template's generation prompt is not a prefix "
                f"of the rendered turn ({_diff(prompt, upto)}); try --template-kwargs (e.g. thinking flags)")
        end = turn_end(upto)
        if not text.startswith(upto[:end]):
            raise ValueError(
                f"sample {sample_id}: assistant message {i} renders differently once later messages follow "
                f"({_diff(upto[:end], text)}); the template rewrites history (e.g. drops reasoning): "
                f"use --split-turns, --last-turn-only or --reasoning drop")
        if end > len(prompt):
            spans.append((len(prompt), end))
    return text, spans


def _diff(a: str, b: str) -> str:
    n = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at character {n}: {a[n:n + 30]!r} vs {b[n:n + 30]!r}"
