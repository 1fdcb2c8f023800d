"""A drafter and its verifier as GGUF files, through llama.cpp's own converter (`convert_hf_to_gguf.py` of the
build `make llamacpp` made): the drafter with the verifier's directory (`--target-model-dir`: its config gives the
layer count, vocabulary and hidden size, its tokenizer the GGUF's vocabulary), the verifier on its own.

`check --engine llamacpp`'s rules run first (the caller's job: `publish/export.py`, `evaluation/llamacpp_engine.py`),
so what reaches the converter converts; a converter failure still ends as one line, its last.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from ..errors import UsageError
from .llamacpp_env import LlamaCpp

OUTTYPES = ("f32", "f16", "bf16", "q8_0")


def run_converter(build: LlamaCpp, model_dir: Path, outfile: Path, outtype: str,
                  target_dir: Path | None = None) -> Path:
    """convert_hf_to_gguf.py MODEL_DIR [--target-model-dir TARGET] --outtype OUTTYPE --outfile OUTFILE."""
    if outtype not in OUTTYPES:
        raise UsageError(f"GGUF type {outtype!r}: expected one of {', '.join(OUTTYPES)}")
    outfile.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(build.converter), str(model_dir), "--outtype", outtype, "--outfile", str(outfile)]
    if target_dir is not None:
        argv += ["--target-model-dir", str(target_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, env=build.converter_env())
    if done.returncode != 0 or not outfile.is_file():
        lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        said = lines[-1] if lines else f"exit status {done.returncode}"
        raise UsageError(f"llama.cpp's converter refused {model_dir}: {said}")
    return outfile


def convert_drafter(build: LlamaCpp, standard_dir: Path, verifier_dir: Path, outfile: Path,
                    outtype: str = "f16") -> Path:
    """A drafter in the standard layout (the one llama.cpp's converter reads as we write it) as a GGUF."""
    return run_converter(build, standard_dir, outfile, outtype, target_dir=verifier_dir)


def verifier_gguf(build: LlamaCpp, verifier_dir: Path, given: str | None, outtype: str, cache: Path,
                  own: Path | None = None) -> Path:
    """The verifier's GGUF: `given` (a file), its `own` file (the embedded default's Q4_1 GGUF) when it has one and
    nothing is given, else (or with given == "convert") its directory converted once at `outtype` into `cache`,
    keyed by the directory's config and weights."""
    if given not in (None, "convert"):
        path = Path(str(given))
        if not path.is_file():
            raise UsageError(f"--verifier-gguf {given}: no such file")
        return path
    if given is None and own is not None:
        return own
    stamp = hashlib.sha256()
    for file in sorted(verifier_dir.glob("*.json")) + sorted(verifier_dir.glob("*.safetensors")):
        stat = file.stat()
        stamp.update(f"{file.name}:{stat.st_size}:{int(stat.st_mtime)}".encode())
    out = cache / f"{verifier_dir.name}-{stamp.hexdigest()[:12]}-{outtype}.gguf"
    if out.is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    run_converter(build, verifier_dir, tmp, outtype)
    tmp.rename(out)  # atomic: a killed conversion never leaves a half-written file under the final name
    return out
