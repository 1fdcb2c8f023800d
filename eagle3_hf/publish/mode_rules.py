"""`check`'s rule on the thinking mode: a drafter serves the mode it was trained in.

A thinking verifier's chat template renders different generation prompts in its two modes (Kimi-K2.5 opens `<think>`
or closes an empty block, switched by `thinking`; Qwen3 by `enable_thinking`), and the model emits reasoning in one
and not in the other. The drafter's config records the chat-template kwargs its training text was rendered with
(`verifier_chat_template_kwargs`, from `prepare --chat-template-kwargs`); vLLM and SGLang render with
`--default-chat-template-kwargs` unless a request sends its own `chat_template_kwargs`. A served value that differs
from a recorded one is an error (drafts for text the server does not produce); with no served value given, the
finding says which kwargs to serve with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .report import Report


def check_thinking_mode(cfg: Mapping[str, Any], rep: Report, served: Mapping[str, Any] | None) -> None:
    """`served`: the chat-template kwargs the server renders with (`check --chat-template-kwargs`), None: unknown."""
    recorded = cfg.get("verifier_chat_template_kwargs")
    if not recorded:  # not recorded (older drafters), or a template rendered without any
        return
    flag = f"--default-chat-template-kwargs '{json.dumps(recorded)}'"
    if served is None:
        rep.add("info", "thinking-mode", f"trained on text rendered with chat-template kwargs {json.dumps(recorded)} "
                f"(the thinking mode): serve with {flag} (vLLM, SGLang; llama.cpp: --chat-template-kwargs), or pass "
                "--chat-template-kwargs to check a server's")
        return
    differ = {k: (v, served[k]) for k, v in recorded.items() if k in served and served[k] != v}
    if differ:
        said = ", ".join(f"{k}: trained {json.dumps(a)}, served {json.dumps(b)}" for k, (a, b) in differ.items())
        rep.add("error", "thinking-mode", f"served in another thinking mode than trained ({said}): the model emits "
                f"other tokens in that mode and the drafter accepts fewer drafts; serve with {flag}, or train on data "
                "prepared with the served --chat-template-kwargs")
    unset = [k for k in recorded if k not in served]
    if unset:
        rep.add("warning", "thinking-mode", f"{', '.join(unset)} not among the served chat-template kwargs: the "
                f"template's default applies, and the drafter was trained with {json.dumps(recorded)}; serve with "
                f"{flag} to be sure")
