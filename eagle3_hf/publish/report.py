"""What `eagle3-hf check` reports: findings, each with its level, and the report that keeps those concerning the
engines asked about. Every rule module adds to a `Report`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..engines.table import checkpoint_engines, engine_names

LEVELS = ("error", "warning", "info")
ENGINES = engine_names()  # the serving engines' table (engines/table.py): sglang, vllm, llamacpp
SERVERS = checkpoint_engines()  # those that load the checkpoint itself (llama.cpp loads its GGUF): `--engine all`


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning" | "info"
    code: str
    message: str

    def __str__(self) -> str:
        return f"{self.level.upper():7s} {self.code}: {self.message}"


class Report:
    """The findings for the engines asked about; a rule names the engines a finding concerns."""

    def __init__(self, engine: str | Iterable[str]):
        wanted = set(SERVERS) if engine == "all" else {engine} if isinstance(engine, str) else set(engine)
        if not wanted or wanted - set(ENGINES):
            raise ValueError(f"engine must be 'all' or among {', '.join(ENGINES)}, got {engine!r}")
        self.engines = wanted
        self.findings: list[Finding] = []

    def add(self, level: str, code: str, message: str, engines: Iterable[str] = ENGINES) -> None:
        if self.engines & set(engines):
            self.findings.append(Finding(level, code, message))
