"""What a `regenerate --endpoint` run leaves beside its answers: OUTPUT's stem + `.summary.json`.

A server rejects some samples for good (HTTP 400/413/422: a prompt over the context length, a malformed tool
message): retrying them is useless and aborting for them loses the run, so each is skipped and recorded here by id
with the server's error message (never the conversation's text), and a rerun does not ask it again unless
`--retry-skipped`. Many rejections stop the run (RejectLimits: in a row, or their share). Other 4xx (401, 403, 404:
a wrong key, URL or model name) concern every sample and still stop the run; 5xx and dropped connections are
retried. The file also counts the turns cut at `--max-new-tokens` (a thinking model's answers are long: a cut answer
is a truncated one) and the last run's counts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EndpointError

FORMAT = "eagle3_hf.regenerate-summary/1"
REJECTED_HTTP = {400, 413, 422}  # this request is refused, not the run
MAX_CONSECUTIVE_REJECTS = 16  # that many rejected in a row: the settings are wrong, not the samples
MAX_REJECT_SHARE = 0.5  # more than this share of the results rejected: the same
SHARE_AFTER = 32  # results (answered + rejected) before the share is judged: a few early rejections are samples


@dataclass(frozen=True)
class RejectLimits:
    """When rejected samples stop the run (`--max-consecutive-rejects`, `--max-reject-share`): a server that rejects
    most requests is misconfigured (a --max-new-tokens over its context, a wrong model or chat format), and skipping
    sample after sample would leave a near-empty output with exit status 0. 0 and 1 turn each rule off."""

    consecutive: int = MAX_CONSECUTIVE_REJECTS
    share: float = MAX_REJECT_SHARE
    share_after: int = SHARE_AFTER

    def __post_init__(self) -> None:
        if self.consecutive < 0 or not 0 < self.share <= 1:
            raise ValueError(f"--max-consecutive-rejects {self.consecutive} / --max-reject-share {self.share}: "
                             "expected a count >= 0 (0: off) and a share in (0, 1] (1: off)")

    def exceeded(self, answered: int, rejected: int, in_a_row: int) -> str | None:
        """Why the run stops after these counts, or None: the rule that bit, in words."""
        if self.consecutive and in_a_row >= self.consecutive:
            return (f"the server rejected {in_a_row} conversations in a row (--max-consecutive-rejects "
                    f"{self.consecutive})")
        results = answered + rejected
        if self.share < 1 and results >= self.share_after and rejected > self.share * results:
            return (f"the server rejected {rejected} of {results} conversations, more than "
                    f"{self.share:.0%} (--max-reject-share {self.share:g}, judged from {self.share_after} results)")
        return None


class RejectedRequest(EndpointError):
    """The server refused this request for good (REJECTED_HTTP): skip its conversation, record why."""

    def __init__(self, url: str, code: int, detail: str):
        super().__init__(f"{url}: HTTP {code}: {detail}")
        self.reason = f"HTTP {code}: {detail}"


def summary_path(output: str | Path) -> Path:
    output = Path(output)
    return output.with_name(output.stem + ".summary.json")


class RegenerateSummary:
    """The summary file of one output, read at the start of a run and rewritten (atomically) as it goes."""

    def __init__(self, output: str | Path):
        self.path = summary_path(output)
        self.data: dict[str, Any] = {"format": FORMAT, "skipped": {}, "cut_at_max_new_tokens": []}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.path}: invalid JSON ({e.msg}); remove it to ask its skipped ids again") \
                    from None
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"{self.path}: not a regenerate summary ({FORMAT})")
            self.data.update(data)

    @property
    def skipped(self) -> dict[str, str]:
        return self.data["skipped"]

    def skip(self, conv_id: str, reason: str) -> None:
        self.skipped[conv_id] = reason
        self.save()

    def answered(self, conv_id: str, finish_reasons: list[str]) -> None:
        """A conversation written: no longer skipped; remembered when a turn hit the token budget."""
        self.skipped.pop(conv_id, None)
        if "length" in finish_reasons and conv_id not in self.data["cut_at_max_new_tokens"]:
            self.data["cut_at_max_new_tokens"].append(conv_id)

    def save(self, **fields: Any) -> None:
        self.data.update(fields)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, ensure_ascii=False, default=dict) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)
