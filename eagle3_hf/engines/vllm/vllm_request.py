"""What `evaluate --engine vllm` and the scripts ask of vllm_runner.py, typed on this side of the venv boundary.

The runner lives in vLLM's venv and reads JSON (its docstring lists the fields); this record is that JSON's one
definition here, so a misspelt field is an error where the request is built, not a default inside the runner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GenerationRequest:
    """One runner process's work: plain decoding, with a drafter, or both (each prompt's two runs back to back)."""

    verifier: str
    prompts: list[list[int]]  # token ids per prompt, the chat template already applied
    max_new_tokens: int = 64
    drafter: str | None = None  # None: plain decoding only
    drafter_revision: str | None = None
    verifier_revision: str | None = None
    method: str | None = None  # vLLM's speculative method for the drafter's kind (engines/table.py)
    k: int = 3
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    max_model_len: int = 2048
    warmup: bool = True
    logprobs: int | None = None  # 2: top-1 minus top-2 gaps per token
    plain: bool = True  # False: only the engine with the drafter
    engine: dict[str, Any] = field(default_factory=dict)  # vllm_args.py's engine options
    trust_remote_code: bool = False

    def replace(self, **changes: Any) -> GenerationRequest:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """The JSON object vllm_runner.py reads."""
        return dataclasses.asdict(self)
