"""User errors: what `eagle3-hf` reports as one line (`error: ...`) instead of a traceback.

A user error is bad input or a bad environment the message itself explains: a missing or corrupt file, a
checkpoint that does not fit, an endpoint that stays down, options that do not fit together (`UsageError`).
Library code raises these and never exits; the CLI treats `Eagle3Error`, `ValueError` and
`OSError` (FileNotFoundError, ENOSPC, ...) as user errors; anything else (TypeError, RuntimeError,
IndexError, ...) is a bug and keeps its full traceback. `--debug` or EAGLE3_HF_DEBUG=1 shows the traceback
of a user error too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Eagle3Error(Exception):
    """Bad input or environment, explained by the message (a project error that is not a ValueError/OSError)."""


USER_ERRORS: tuple[type[BaseException], ...] = (Eagle3Error, ValueError, OSError)

DEBUG_ENV = "EAGLE3_HF_DEBUG"  # `eagle3-hf --debug` sets it, so the processes a command starts see it too


def debug_requested() -> bool:
    """EAGLE3_HF_DEBUG is set and not 0 (nor false/no/off): user errors keep their traceback, and the engines a
    command starts (vLLM, the feature server) show their own logs. The one reading of the variable."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class UsageError(Eagle3Error):
    """Options that do not fit together, or do not fit the data they name (raised by library code; the CLI, the
    only place that turns errors into exit codes, prints it as one line)."""


class EndpointError(Eagle3Error):
    """An HTTP endpoint (the chat server `regenerate` asks, a vLLM server writing hidden states) that is missing,
    misconfigured, refuses, fails or stays too slow past its retries: the message names it and how to resume."""


class NonFiniteError(Eagle3Error):
    """NaN/Inf where a number must be finite (a loss, a weight about to be saved or served)."""


def non_finite_names(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors of a state dict holding NaN or Inf (empty ZeRO-3 shards skipped)."""
    return [name for name, t in tensors.items()
            if t.is_floating_point() and t.numel() and not bool(t.isfinite().all())]


def describe_non_finite(names: list[str]) -> str:
    """'3 tensors contain NaN/Inf (a, b, c)', at most four names."""
    more = ", ..." if len(names) > 4 else ""
    return f"{len(names)} tensor(s) contain NaN/Inf ({', '.join(names[:4])}{more})"


def run_reporting_user_errors(run: Callable[[list[str]], Any], argv: list[str], debug: bool = False) -> int:
    """`run(argv)` with a user error printed as one line `error: ...` (exit status 1); other exceptions propagate.
    The shared entry of `eagle3-hf` and the training script; `debug` or EAGLE3_HF_DEBUG=1 re-raises everything."""
    if debug or debug_requested():
        result = run(argv)
        return result if isinstance(result, int) else 0
    try:
        result = run(argv)
    except USER_ERRORS as exc:
        return _one_line(worker_message(str(exc)) or type(exc).__name__)
    except SystemExit as exc:
        if isinstance(exc.code, str):  # raise SystemExit("message"): a user error too
            return _one_line(exc.code)
        raise
    return result if isinstance(result, int) else 0


def worker_message(message: str) -> str:
    """A user error raised in a DataLoader worker comes back as 'Caught X in DataLoader worker process N.'
    followed by the worker's traceback: its own message is the traceback's last line, after 'module.X: '."""
    if not message.startswith("Caught ") or "\nOriginal Traceback" not in message:
        return message
    last = [ln for ln in message.splitlines() if ln.strip()][-1]
    head, sep, rest = last.partition(": ")
    return rest if sep and " " not in head else last


def _one_line(message: str) -> int:
    print(f"error: {message.strip()}", file=sys.stderr)  # a list of findings may follow on indented lines
    return 1


def json_object(text: str) -> dict[str, Any]:
    """A command-line JSON object (`--chat-template-kwargs`): anything else is refused by argparse in one line naming
    the flag."""
    import argparse
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value
