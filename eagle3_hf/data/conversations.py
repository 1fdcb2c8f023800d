"""Conversations in, one normalised shape out: `{"id": str, "messages": [{"role", "content", ...}]}`.

Plain text for base verifiers (`prepare --text`) goes through the same readers as
`{"id", "prompt", "completion"}` (`normalize_text_row`).

Accepted inputs: JSONL in ShareGPT form (`{"conversations": [{"from", "value"}]}`) or OpenAI form
(`{"messages": [{"role", "content", "reasoning_content"?, "tool_calls"?}]}`; `reasoning`, the name newer servers
give the reasoning, is read as `reasoning_content`), a `datasets` dataset saved
with `save_to_disk`, or a Hub dataset id. Every later stage (prepare, regenerate) reads this one shape, so
a malformed row is refused here with its file and line rather than turning into a wrong loss mask later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT speaker names seen in the wild -> OpenAI roles.
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_OPTIONAL_KEYS = ("reasoning_content", "tool_calls", "tool_call_id", "name")


def _text(content: Any, where: str) -> str:
    """OpenAI content is a string or a list of parts; only text parts can be trained on."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}: content part of type {kind!r} is not text")
        return "".join(texts)
    raise ValueError(f"{where}: content must be a string, got {type(content).__name__}")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"{where}: tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: tool_calls[{j}] needs function.name")
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):  # some datasets store parsed JSON; templates expect the string
            args = json.dumps(args, ensure_ascii=False)
        item = {"type": call.get("type") or "function", "function": {"name": fn["name"], "arguments": args}}
        if call.get("id") is not None:
            item["id"] = str(call["id"])
        out.append(item)
    return out


def normalize_conversation(row: Any, where: str, index: int) -> dict:
    """One input row -> `{"id", "messages"}` (+ `tools` when given). `where` names the row in errors."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if row.get("messages") is not None:
        raw, role_key, text_key, roles = row["messages"], "role", "content", _OPENAI_ROLES
    elif row.get("conversations") is not None:
        raw, role_key, text_key, roles = row["conversations"], "from", "value", _SHAREGPT_ROLES
    else:
        raise ValueError(f"{where}: no 'messages' (OpenAI) or 'conversations' (ShareGPT) key")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: conversation must be a non-empty list of messages")
    messages = []
    for j, msg in enumerate(raw):
        at = f"{where}: message {j}"
        if not isinstance(msg, dict):
            raise ValueError(f"{at}: expected an object, got {type(msg).__name__}")
        speaker = msg.get(role_key)
        if speaker not in roles:
            raise ValueError(f"{at}: unknown {role_key} {speaker!r} (known: {', '.join(sorted(roles))})")
        out: dict[str, Any] = {"role": roles[speaker], "content": _text(msg.get(text_key), at)}
        for key in _OPTIONAL_KEYS:  # keys absent or None stay absent: templates test `'tool_calls' in message`
            value = msg.get(key)
            if value is None:
                continue
            if key == "tool_calls":
                if out["role"] != "assistant":
                    raise ValueError(f"{at}: tool_calls on a {out['role']} message")
                value = _tool_calls(value, at)
                if not value:
                    continue
            elif not isinstance(value, str):
                raise ValueError(f"{at}: {key} must be a string")
            out[key] = value
        if "reasoning_content" not in out and msg.get("reasoning") is not None:  # newer servers' name for it
            if not isinstance(msg["reasoning"], str):
                raise ValueError(f"{at}: reasoning must be a string")
            out["reasoning_content"] = msg["reasoning"]
        messages.append(out)
    conv_id = row.get("id")
    conv = {"id": str(conv_id) if conv_id is not None else f"row-{index}", "messages": messages}
    if row.get("tools") is not None:
        if not isinstance(row["tools"], list):
            raise ValueError(f"{where}: tools must be a list")
        conv["tools"] = row["tools"]
    return conv


def normalize_text_row(row: Any, where: str, index: int) -> dict:
    """A plain-text row for base verifiers -> `{"id", "prompt", "completion"}`.

    `{"prompt", "completion"}`: loss on the completion, the prompt is context; `{"text"}`: loss on all of it.
    """
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if isinstance(row.get("completion"), str):
        prompt, completion = row.get("prompt", ""), row["completion"]
    elif isinstance(row.get("text"), str):
        prompt, completion = "", row["text"]
    else:
        raise ValueError(f"{where}: plain-text mode needs a string 'completion' (with an optional 'prompt') "
                         f"or 'text' (has {sorted(row)})")
    if not isinstance(prompt, str):
        raise ValueError(f"{where}: 'prompt' must be a string, got {type(prompt).__name__}")
    row_id = row.get("id")
    return {"id": str(row_id) if row_id is not None else f"row-{index}", "prompt": prompt, "completion": completion}


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, parsed object) for each non-blank line; invalid JSON names file:line."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None


def _check_unique(convs: list[dict], source: str) -> list[dict]:
    seen: dict[str, int] = {}
    for i, conv in enumerate(convs):
        if conv["id"] in seen:
            raise ValueError(f"{source}: duplicate id {conv['id']!r} (rows {seen[conv['id']]} and {i})")
        seen[conv["id"]] = i
    return convs


def _iter_rows(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """JSONL lines, or the items of a JSON array (ShareGPT dumps are often one big `.json` list)."""
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    if str(path).endswith(".json") and head.startswith("["):
        with open(path, encoding="utf-8") as f:
            try:
                items = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        for i, row in enumerate(items):
            yield f"{path} item {i}", row
    else:
        for line_no, row in iter_jsonl(path):
            yield f"{path}:{line_no}", row


def read_jsonl_conversations(path: str | os.PathLike, limit: int | None = None,
                             normalize: Callable[[Any, str, int], dict] = normalize_conversation) -> list[dict]:
    convs = []
    for index, (where, row) in enumerate(_iter_rows(path)):
        if limit is not None and index >= limit:
            break
        convs.append(normalize(row, where, index))
    return _check_unique(convs, str(path))


def read_dataset_conversations(source: str, split: str = "train", limit: int | None = None,
                               normalize: Callable[[Any, str, int], dict] = normalize_conversation) -> list[dict]:
    """A `save_to_disk` directory or a Hub dataset id (a DatasetDict is indexed by `split`)."""
    import datasets

    if Path(source).is_dir() and any((Path(source) / f).exists() for f in ("state.json", "dataset_dict.json")):
        ds = datasets.load_from_disk(source)
    else:
        ds = datasets.load_dataset(source, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{source}: no split {split!r} (has {', '.join(ds)})")
        ds = ds[split]
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    convs = [normalize(row, f"{source} row {i}", i) for i, row in enumerate(ds)]
    return _check_unique(convs, source)


def load_conversations(source: str, limit: int | None = None, split: str = "train", text: bool = False) -> list[dict]:
    """`default` (the embedded training set), a .jsonl file, a saved dataset directory or a Hub id.
    `text=True` reads plain-text rows (`normalize_text_row`) instead of conversations."""
    normalize = normalize_text_row if text else normalize_conversation
    if source == "default":
        if text:
            raise ValueError("--input default is a set of conversations; plain-text mode needs a file or dataset")
        from eagle3_hf.demo_data.prompts import training_conversations

        return training_conversations(limit)
    path = Path(source)
    if path.is_file():
        return read_jsonl_conversations(path, limit, normalize)
    if source.endswith((".jsonl", ".json")) and not path.exists():
        raise FileNotFoundError(f"{source}: no such file")
    return read_dataset_conversations(source, split=split, limit=limit, normalize=normalize)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict], append: bool = False) -> int:
    """Write rows one JSON object per line; returns the count. Appends are fsync'd so a kill loses nothing."""
    n = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    return n
