"""`--trust-remote-code`: off by default on every command that opens a verifier, its config or its tokenizer.

A checkpoint whose config or tokenizer names its own Python code (`auto_map`: Kimi-K2.5's tokenizer and config,
DeepSeek's older releases) runs that code when loaded. Never by default: the command's flag sets it for the
process (`set_trusted`, called by the CLI and the training script), transformers gets it explicitly (never its
interactive prompt), and vLLM gets it through the engine options (engines/vllm/vllm_args.py). Without it, such a model
fails in one line naming the flag; with it, code that imports a package this environment lacks (Kimi-K2.5's
tokenizer imports `tiktoken`) fails in one line naming the package and how to install it. Ranks of one launch load
that code one at a time, local rank 0 first (code_cache.py: a cold modules cache is otherwise a copy race).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from ..errors import Eagle3Error
from .code_cache import one_loader_at_a_time

FLAG = "--trust-remote-code"
_TRUSTED = {"value": False}
# packages a known verifier's own code imports, and the extra of this project that installs them (pyproject.toml)
EXTRAS = {"tiktoken": "kimi"}
_TRANSFORMERS_MISSING = re.compile(r"packages that were not found in your environment: ([^.]+)\.")
T = TypeVar("T")


class RemoteCodeError(Eagle3Error):
    """A checkpoint needs its own code and --trust-remote-code was not given."""


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FLAG, action="store_true",
                        help="run the Python code a verifier or tokenizer ships (auto_map), in transformers and vLLM; "
                             "off by default: only for checkpoints you trust")


def set_trusted(value: bool) -> None:
    """This process's choice (the command's flag)."""
    _TRUSTED["value"] = bool(value)


def trusted() -> bool:
    return _TRUSTED["value"]


def declares_code(name_or_path: str) -> bool:
    """Whether a local checkpoint's config.json or tokenizer_config.json names code of its own (auto_map)."""
    for filename in ("config.json", "tokenizer_config.json"):
        path = Path(name_or_path) / filename
        try:
            if path.is_file() and json.loads(path.read_text(encoding="utf-8")).get("auto_map"):
                return True
        except (OSError, ValueError):
            continue
    return False


@contextmanager
def opening(name_or_path: str, what: str) -> Iterator[None]:
    """Turn transformers' failure on a checkpoint that needs its own code (untrusted) into one line naming FLAG, and an
    ImportError while loading (trusted code importing a package not installed) into one line naming the package."""
    try:
        yield
    except (ValueError, OSError, KeyError, AttributeError, ImportError) as exc:
        text = str(exc)
        needs = "trust_remote_code" in text or "custom code" in text or declares_code(str(name_or_path))
        if not trusted() and needs:
            raise RemoteCodeError(f"{name_or_path}: its {what} needs the Python code it ships (auto_map); pass {FLAG} "
                                  "if you trust it") from None
        if isinstance(exc, ImportError):
            raise missing_package(name_or_path, what, exc) from None
        raise


def missing_package(name_or_path: str, what: str, exc: ImportError) -> RemoteCodeError:
    """An ImportError raised while loading a checkpoint (its own code, or a library transformers needs for it) as one
    line: the package(s) missing and the pip command, or the import that failed."""
    found = _TRANSFORMERS_MISSING.search(str(exc))  # transformers checks a remote module's imports first
    packages = [p.strip() for p in found.group(1).split(",")] if found else []
    if not packages and isinstance(exc, ModuleNotFoundError) and exc.name:
        packages = [exc.name.split(".")[0]]
    if not packages:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return RemoteCodeError(f"{name_or_path}: loading its {what} failed to import: {first}")
    extras = sorted({EXTRAS[p] for p in packages if p in EXTRAS})
    hint = f" (or this project's extra: pip install -e '.[{','.join(extras)}]')" if extras else ""
    return RemoteCodeError(f"{name_or_path}: its {what} needs {', '.join(packages)}, not installed here: pip install "
                           f"{' '.join(packages)}{hint}")


def load_with_trust(loader: Callable[..., T], name_or_path: str, what: str, **kwargs: object) -> T:
    """`loader(name_or_path, trust_remote_code=trusted(), **kwargs)`, its remote-code failure in one line. Trusted,
    the load holds the modules cache's lock, local rank 0 first (code_cache.py)."""
    with opening(name_or_path, what):
        if not trusted():
            return loader(name_or_path, trust_remote_code=False, **kwargs)
        with one_loader_at_a_time():
            return loader(name_or_path, trust_remote_code=True, **kwargs)
