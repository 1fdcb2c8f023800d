"""One identity for a tokenizer, so features, vocabularies and drafters built for another one are refused; and the
class that tokenized the data, so no stage silently loads another one.

The fingerprint covers what ids MEAN (token -> id, special tokens). Two classes over one vocabulary can still
split a text into other ids (a checkpoint's own remote-code tokenizer, loaded with --trust-remote-code, beside
the fast tokenizer transformers builds without it), so `prepare` records the class it used and whether it
trusted the checkpoint's code (`tokenizer_record`), the feature directory and the drafter carry the class on, and
`extract`, `train` and `evaluate` refuse another class in one line (`check_tokenizer_class`). The same record carries
the chat-template kwargs the text was rendered with (the thinking mode, data/thinking_mode.py) from the prepared meta
through the feature manifest into the drafter's config, where its serve lines and `check` read it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RECORD_KEYS = ("tokenizer_class", "trust_remote_code", "chat_template_kwargs")


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 (16 hex) over the token -> id map and the special tokens: equal iff ids mean the same text."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in tokenizer.all_special_tokens)
    payload = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def tokenizer_record(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """How this process loaded `tokenizer`: its class and whether the checkpoint's own code was trusted."""
    from ..verifier.remote_code import trusted

    return {"tokenizer_class": type(tokenizer).__name__, "trust_remote_code": trusted()}


def recorded_tokenizer(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """The tokenizer record held by a prepared meta or a feature manifest ({} where none was written)."""
    return {k: record[k] for k in RECORD_KEYS if record and record.get(k) is not None}


def check_tokenizer_class(record: Mapping[str, Any] | None, tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    """Refuse `tokenizer` when `record` (see `recorded_tokenizer`) names another class, in one line naming both."""
    from ..errors import UsageError
    from ..verifier.remote_code import FLAG

    recorded = recorded_tokenizer(record)
    found = tokenizer_record(tokenizer)
    if not recorded.get("tokenizer_class") or recorded["tokenizer_class"] == found["tokenizer_class"]:
        return

    def how(rec: Mapping[str, Any]) -> str:
        flag = rec.get("trust_remote_code")
        return f"{rec['tokenizer_class']}" + ("" if flag is None else f" ({'with' if flag else 'without'} {FLAG})")

    raise UsageError(f"{where}: tokenized by {how(recorded)}, but this command loaded {how(found)}: give every "
                     f"stage the {FLAG} that prepare had")
