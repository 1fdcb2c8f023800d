"""The thinking mode a chat template renders: part of the drafter's contract, like the tokenizer.

Kimi-K2.x and Qwen3 switch thinking with a template variable (`thinking`, `enable_thinking`) that a server receives
as chat-template kwargs (per request `chat_template_kwargs`, or vLLM's and SGLang's `--default-chat-template-kwargs`).
The two modes render different generation prompts (Kimi: `<think>` opened, or an empty `<think></think>` closed;
Qwen3: the bare header, or an empty block closed), so the model emits different tokens after them: a drafter
trained in one mode serves the other badly. The mode is therefore found here from the template itself (which
variable changes its generation prompt, and what it renders when the variable is not given), recorded with the
prepared data, carried into the drafter's config and printed in its serve lines.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SWITCHES = ("enable_thinking", "thinking")  # the variables thinking templates read, Qwen3's and Kimi's
OPEN, CLOSE = "<think>", "</think>"
_PROBE = [{"role": "user", "content": "Hi"}]
_EMPTY_BLOCK_AT_END = re.compile(re.escape(OPEN) + r"\s*" + re.escape(CLOSE) + r"\s*$")


@dataclass(frozen=True)
class ThinkingMode:
    """The template's thinking switch: `variable` (None: the template has none), its `value` as rendered, and whether
    the user `given` it (else the template's default was used)."""

    variable: str | None
    value: bool | None
    given: bool

    def default_line(self) -> str | None:
        """One line for a template with a switch the user did not set: which mode the data is rendered in."""
        if self.variable is None or self.given:
            return None
        if self.value is None:
            return (f"the chat template switches thinking with `{self.variable}` and its default could not be read; "
                    f"pass --chat-template-kwargs '{{\"{self.variable}\": true}}' (or false) to choose the mode")
        other = json.dumps({self.variable: not self.value})
        return (f"the chat template switches thinking with `{self.variable}` (default {json.dumps(self.value)}); "
                f"rendering with thinking {'on' if self.value else 'off'}: serve the drafter the same way, or pass "
                f"--chat-template-kwargs '{other}' for the other mode")


def render_prompt(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any], tools: list | None = None) -> str | None:
    """The generation prompt of a one-message conversation with `kwargs`; None where the template cannot render it."""
    try:
        return str(tokenizer.apply_chat_template(_PROBE, tools=tools, add_generation_prompt=True, tokenize=False,
                                                 **kwargs))
    except Exception:  # a template that needs more than one user message (a system turn, tools) says nothing here
        return None


def thinking_mode(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any] | None = None) -> ThinkingMode:
    """The switch of the tokenizer's template (or of `template_kwargs['chat_template']`) and the mode rendered with
    `template_kwargs`: a variable of SWITCHES counts when setting it true or false changes the generation prompt."""
    from .chat_render import chat_template_source

    kwargs = dict(template_kwargs or {})
    source = chat_template_source(tokenizer, None, kwargs)
    for name in SWITCHES:
        if not re.search(rf"(?<![\w.'\"]){name}(?![\w'\"])", source):
            continue
        rest = {k: v for k, v in kwargs.items() if k != name}
        on, off = render_prompt(tokenizer, {**rest, name: True}), render_prompt(tokenizer, {**rest, name: False})
        if on is None or on == off:
            continue
        if name in kwargs:
            return ThinkingMode(name, bool(kwargs[name]), True)
        unset = render_prompt(tokenizer, rest)
        return ThinkingMode(name, True if unset == on else False if unset == off else None, False)
    return ThinkingMode(None, None, False)


def prompt_closes_block(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict[str, Any] | None = None,
                        tools: list | None = None) -> bool:
    """The generation prompt ends with an empty, closed think block (thinking off): the model emits no reasoning."""
    prompt = render_prompt(tokenizer, dict(template_kwargs or {}), tools)
    return prompt is not None and _EMPTY_BLOCK_AT_END.search(prompt) is not None


def split_emitted(prompt: str, text: str) -> tuple[str, str | None]:
    """(answer, reasoning or None) of a text generated after `prompt`, as a server's reasoning parser splits it: where
    the prompt opened a think block (Kimi-K2.5 thinking on, R1), the text up to the first `</think>` is the
    reasoning and the rest the answer, so the answered conversation renders as the template renders it (else the
    history would hold `REASONING</think>ANSWER` as the answer's text); anywhere else the text is the answer."""
    if not prompt.rstrip(" \n").endswith(OPEN) or CLOSE not in text:
        return text, None
    reasoning, _, answer = text.partition(CLOSE)
    return answer, reasoning.strip("\n")


def served_kwargs(template_kwargs: dict[str, Any] | None, mode: ThinkingMode) -> dict[str, Any]:
    """The chat-template kwargs a server must render with to match the data: those given (a `chat_template` text is
    not one: the served template is the server's), plus the switch at its default when it was not given."""
    out = {k: v for k, v in (template_kwargs or {}).items() if k != "chat_template"}
    if mode.variable is not None and mode.variable not in out and mode.value is not None:
        out[mode.variable] = mode.value
    return out
