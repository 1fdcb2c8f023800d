"""The answers file of `regenerate`: JSONL, one finished conversation per line, appended, flushed and fsync'd, so
a killed run resumes from the ids already there with nothing lost or duplicated."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def completed_ids(path: str | Path) -> set[str]:
    """Ids already in the output. A torn last line (killed mid-write) is cut off; other damage is refused."""
    path = Path(path)
    if not path.exists():
        return set()
    raw = path.read_bytes()
    end = raw.rfind(b"\n") + 1  # a line is written with its newline last: anything after it is torn
    ids: set[str] = set()
    for line_no, line in enumerate(raw[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg}); fix or remove the file") from None
        if not isinstance(row, dict) or "id" not in row:
            raise ValueError(f"{path}:{line_no}: not a regenerated conversation (no id)")
        if str(row["id"]) in ids:
            raise ValueError(f"{path}:{line_no}: duplicate id {row['id']!r}")
        ids.add(str(row["id"]))
    if end < len(raw):
        print(f"regenerate: {path}: dropping an unfinished last line ({len(raw) - end} bytes)", file=sys.stderr)
        with open(path, "r+b") as f:
            f.truncate(end)
    return ids


class ConversationWriter:
    """Appends finished conversations to the answers file, one JSON line each, flushed and fsync'd: a kill
    loses at most the line being written (the reader drops an unfinished last line)."""

    def __init__(self, path: str | Path):
        self.f = open(path, "a", encoding="utf-8")

    def __call__(self, row: dict) -> None:
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def put_in_input_order(path: str | Path, order: list[str]) -> bool:
    """Rewrite the answers file with its conversations in the input's order (ids not in `order` last, as they were).

    Requests answered concurrently finish in any order, and the file is appended as they do; left so, the same
    prompts and seed would train a different drafter each run (prepare and the packing keep the file's order).
    Replaced atomically, only when the order differs. Returns whether it rewrote the file."""
    path = Path(path)
    if not path.exists():
        return False
    lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
    rank = {conv_id: i for i, conv_id in enumerate(order)}
    keys = [rank.get(str(json.loads(line)["id"]), len(rank)) for line in lines]
    ordered = [line for _, _, line in sorted(zip(keys, range(len(lines)), lines, strict=True))]
    if ordered == lines:
        return False
    tmp = path.with_name(path.name + ".ordering")
    with open(tmp, "wb") as f:
        f.write(b"".join(line + b"\n" for line in ordered))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return True
