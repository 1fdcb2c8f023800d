"""The drafter kind a checkpoint declares (its config.json's `architectures`, as vLLM picks the model class), for a
directory or a Hub repo: what `evaluate` and the kinds' contract test load it by."""

from __future__ import annotations

import json
import os

from ..engines.table import EAGLE3, DrafterKind, drafter_kind
from .checkpoint import resolve_checkpoint


def checkpoint_drafter_kind(name_or_path: str | os.PathLike, revision: str | None = None) -> DrafterKind:
    """The drafter kind (engines/table.py) a directory or Hub repo declares in its config.json; EAGLE-3 without one
    (the EAGLE-3 reader then names what is missing)."""
    config_file = resolve_checkpoint(name_or_path, revision=revision) / "config.json"
    if not config_file.is_file():
        return EAGLE3
    with open(config_file, encoding="utf-8") as f:
        return drafter_kind(json.load(f))
