"""Where `make llamacpp` (scripts/install_llamacpp.sh) left llama.cpp: its server, its GGUF converter and the
converter's own Python package, all in the user cache, outside the clone.

The build is found at EAGLE3_HF_LLAMACPP_DIR, else at ~/.cache/eagle3_hf/llamacpp/<llama-cpp-python version>; a
missing one is one line saying what to run. The converter runs with our own Python (it needs torch, transformers
and numpy, which our venv has; it puts its own `gguf-py` first on its path), and `sentencepiece`, which the Llama
converter imports even for a BPE tokenizer, from the build's own `python` folder.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

LLAMACPP_PY_VERSION = "0.3.36"  # scripts/install_llamacpp.sh pins the same source distribution
STAMP = ".eagle3_hf_llamacpp"


def llamacpp_dir() -> Path:
    """The build's root: EAGLE3_HF_LLAMACPP_DIR, else the user cache's folder for the pinned version."""
    given = os.environ.get("EAGLE3_HF_LLAMACPP_DIR", "").strip()
    return Path(given) if given else Path.home() / ".cache" / "eagle3_hf" / "llamacpp" / LLAMACPP_PY_VERSION


@dataclass(frozen=True)
class LlamaCpp:
    """The pieces of one llama.cpp build."""

    root: Path

    @property
    def tree(self) -> Path:
        return self.root / f"llama_cpp_python-{LLAMACPP_PY_VERSION}" / "vendor" / "llama.cpp"

    @property
    def server(self) -> Path:
        return self.tree / "build" / "bin" / "llama-server"

    @property
    def converter(self) -> Path:
        return self.tree / "convert_hf_to_gguf.py"

    @property
    def python_path(self) -> list[Path]:
        """What the converter imports beyond our venv and its own gguf-py: the build's sentencepiece."""
        return [self.root / "python"]

    def converter_env(self) -> dict[str, str]:
        paths = [str(p) for p in self.python_path] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
        env = dict(os.environ, PYTHONPATH=":".join(paths))
        env.pop("NO_LOCAL_GGUF", None)  # the converter puts its own gguf-py first unless this is set
        return env

    def version(self) -> str:
        """`llama-server --version`'s build line, e.g. "version: 1 (0c1e570)"."""
        out = subprocess.run([str(self.server), "--version"], capture_output=True, text=True, timeout=60)
        lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
        return lines[0].removeprefix("version: ") if lines else "unknown"


def find_llamacpp(need_server: bool = True) -> LlamaCpp:
    """The build, or one line saying how to make it (UsageError)."""
    build = LlamaCpp(llamacpp_dir())
    missing = [p for p in ([build.server] if need_server else []) + [build.converter] if not p.is_file()]
    if missing or not (build.root / STAMP).is_file():
        raise UsageError(f"llama.cpp is not built in {build.root}: run `make llamacpp` (builds llama-server and "
                         "takes the GGUF converter from llama-cpp-python's source distribution on PyPI; "
                         "EAGLE3_HF_LLAMACPP_DIR names another build)")
    return build
