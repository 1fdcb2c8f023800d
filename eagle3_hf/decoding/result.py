"""What a decoder returns: typed records instead of dicts, so a caller reads `out.tokens`, and a misspelt field
fails where it is written instead of reading as missing. `dataclasses.asdict` gives the old dict where JSON
needs one."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeResult:
    """Plain decoding (`greedy_generate`): the baseline of the lossless check and of the speedup."""

    tokens: list[int]  # the new tokens, the prompt excluded
    margins: list[float]  # top-1 minus top-2 verifier logit before each token (the tie test)
    num_verifier_forwards: int
    seconds: float


@dataclass
class SpeculativeResult(DecodeResult):
    """Speculative decoding (chain or tree): one record per verify forward; the prefill is not counted."""

    accepted_per_step: list[int] = field(default_factory=list)  # drafts accepted
    drafted_per_step: list[int] = field(default_factory=list)  # chain length, or the tree's depth
    draft_tokens: list[list[int]] = field(default_factory=list)  # the proposals (a tree's nodes, root excluded)
    tree_size_per_step: list[int] | None = None  # tree nodes read by the verifier, root included (trees only)
    verify_seconds: list[float] | None = None  # seconds of each verifier forward over a tree (trees only)

    @property
    def acceptance_length(self) -> float | None:
        """τ: tokens per verify forward (accepted drafts + the verifier's own), None without a verify forward."""
        steps = len(self.accepted_per_step)
        return (sum(self.accepted_per_step) + steps) / steps if steps else None
