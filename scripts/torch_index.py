#!/usr/bin/env python3
"""Where pip finds CPU torch: the pip arguments that make a torch pin like `torch==2.13.0+cpu` resolvable.

PyPI carries no `+cpu` torch builds; PyTorch's CPU wheel index does. A machine whose pip configuration
already finds the pin (a mirror, a wheel folder, an index set in PIP_EXTRA_INDEX_URL) needs nothing added;
a plain machine needs `--extra-index-url` with PyTorch's CPU index; a machine that reaches neither gets one line
that says what to do. Used by scripts/install_vllm.sh and the Makefile's venv; standard library only, run
by the interpreter of the venv being built (its pip answers the question).

    python scripts/torch_index.py 'torch==2.13.0+cpu'          # prints the arguments to add, one per line
    python scripts/torch_index.py --from-constraints FILE      # the torch pin read from a pip freeze
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

# PyTorch's CPU wheel index; EAGLE3_HF_TORCH_INDEX points elsewhere (a mirror of it)
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

Probe = Callable[[str, Sequence[str]], bool]


class TorchNotFound(Exception):
    """Neither the configured indexes nor PyTorch's CPU index has the pin; the message is one line."""


def torch_pin(constraints: str) -> str:
    """The `torch==...` line of a pip freeze / constraints file."""
    for line in constraints.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.lower().startswith("torch=="):
            return line
    raise ValueError("no torch== pin in the constraints")


def pip_resolves(python: str, timeout: float = 30.0) -> Probe:
    """A probe asking `python -m pip` whether it can resolve a requirement alone (no dependencies, nothing
    installed: `pip install --dry-run`), with the given extra arguments; an unreachable index fails fast."""

    def probe(requirement: str, extra: Sequence[str]) -> bool:
        cmd = [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--retries", "0", "--timeout", str(int(timeout)), *extra, requirement]
        try:
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout * 4)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    return probe


def index_args(requirement: str, resolves: Probe, cpu_index: str = CPU_INDEX) -> list[str]:
    """The pip arguments to add so that `requirement` installs: none when the configured indexes already have
    it, `--extra-index-url CPU_INDEX` when only PyTorch's CPU index does; TorchNotFound (one line) otherwise."""
    if resolves(requirement, []):
        return []
    extra = ["--extra-index-url", cpu_index]
    if resolves(requirement, extra):
        return extra
    raise TorchNotFound(
        f"{requirement} is on none of pip's configured indexes and PyTorch's CPU wheel index ({cpu_index}) "
        f"did not answer: make that index reachable, or point pip at a copy of the wheel "
        f"(PIP_FIND_LINKS=DIR or EAGLE3_HF_TORCH_INDEX=URL), and run the command again")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requirement", nargs="?", help="a torch pin, e.g. torch==2.13.0+cpu")
    parser.add_argument("--from-constraints", metavar="FILE", help="read the torch pin from this pip freeze")
    parser.add_argument("--python", default=sys.executable, help="whose pip to ask (default: this interpreter)")
    args = parser.parse_args(argv)
    if bool(args.requirement) == bool(args.from_constraints):
        parser.error("give a requirement or --from-constraints FILE")
    if args.from_constraints:
        with open(args.from_constraints, encoding="utf-8") as f:
            requirement = torch_pin(f.read())
    else:
        requirement = args.requirement
    cpu_index = os.environ.get("EAGLE3_HF_TORCH_INDEX") or CPU_INDEX
    try:
        extra = index_args(requirement, pip_resolves(args.python), cpu_index)
    except TorchNotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for arg in extra:
        print(arg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
