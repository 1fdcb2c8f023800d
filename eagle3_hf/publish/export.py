"""`eagle3-hf export`: rewrite a drafter (any supported layout, local or on the Hub) in the standard or the
speculators layout, or as a GGUF for llama.cpp. The layouts themselves are defined in
`eagle3_hf/model/checkpoint.py`; the GGUF is written by llama.cpp's own converter (`make llamacpp`), after
`check --engine llamacpp`'s rules (`llamacpp_rules.py`) found nothing it would refuse or serve wrongly."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..engines.table import EAGLE3, DrafterKind, checkpoint_kind
from ..errors import UsageError
from .serving import PUSH_DTYPES

GGUF_DRAFTER = "{kind}-drafter-{outtype}.gguf"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="drafter directory or Hub repo id (any supported layout)")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--format", choices=["standard", "speculators", "gguf"], default="standard",
                        help="gguf: llama.cpp's drafter file (`make llamacpp` first; needs --verifier), and the "
                             "verifier's GGUF when it has none")
    parser.add_argument("--verifier", help="verifier (name or path): its embedding fills embed_tokens; --format "
                                           "gguf: its directory gives the converter the layers and the tokenizer")
    parser.add_argument("--include-embed-tokens", action="store_true",
                        help="standard layout: also write embed_tokens (engines normally take the verifier's)")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--dtype", default=None, choices=[*PUSH_DTYPES, *PUSH_DTYPES.values()],
                        help="the floating weights' dtype, as `push --dtype` (bf16 is what `push` uploads by "
                             "default; d2t and t2d keep theirs); default: the checkpoint's")
    parser.add_argument("--gguf-type", default="f16", choices=["f32", "f16", "bf16", "q8_0"],
                        help="--format gguf: the drafter's (and a converted verifier's) tensor type (default: "
                             "%(default)s)")
    parser.add_argument("--verifier-gguf", default=None,
                        help="--format gguf: the verifier's GGUF, printed in the serve line; default: the embedded "
                             "default's own file, else the verifier's directory converted into --output; "
                             "'convert' converts even the embedded default")


def local_verifier_dir(verifier: str, given_gguf: str | None) -> Path:
    """The verifier's directory for llama.cpp's converter: the embedded default's cache, a local path, or a Hub
    repo's config and tokenizer files, with its weights only when its own GGUF is to be converted (a drafter's
    conversion reads none of them)."""
    from ..verifier.loading import DEFAULT_VERIFIER, resolve_verifier

    path = Path(resolve_verifier(verifier))
    if (path / "config.json").is_file():
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "tokenizer.model", "*.txt", "*.tiktoken"]
    if given_gguf == "convert" or (given_gguf is None and verifier not in (DEFAULT_VERIFIER, "default")):
        patterns.append("*.safetensors")
    return Path(snapshot_download(verifier, allow_patterns=patterns))


def drafter_kind_of(drafter: str, revision: str | None = None) -> DrafterKind:
    """The kind of drafter (engines/table.py) its config.json declares; a Hub repo's config.json alone is fetched."""
    from .check import resolve_checkpoint

    return checkpoint_kind(resolve_checkpoint(drafter, revision, ["config.json"]))


def drafter_gguf(build: Any, drafter: str, verifier_dir: Path, outfile: Path, outtype: str,
                 revision: str | None = None) -> Path:
    """The drafter (any layout we read, local or on the Hub) as a GGUF. An EAGLE-3 drafter is rewritten in the
    standard layout first; a DFlash drafter is already in the one layout the engines read and converts as it is
    (llama.cpp's converter picks its DFlash class by the config's `architectures`)."""
    from ..engines.llamacpp_convert import convert_drafter
    from ..model.modeling_eagle3 import Eagle3DraftModel

    if drafter_kind_of(drafter, revision) is not EAGLE3:
        from .check import resolve_checkpoint

        root = resolve_checkpoint(drafter, revision, ["*.json", "*.safetensors"])
        return convert_drafter(build, root, verifier_dir, outfile, outtype)
    model = Eagle3DraftModel.from_pretrained(drafter, revision=revision, dtype="float32")
    with tempfile.TemporaryDirectory(prefix="eagle3_gguf_") as tmp:
        model.save_pretrained(tmp)
        return convert_drafter(build, Path(tmp), verifier_dir, outfile, outtype)


def verifier_gguf_of(build: Any, verifier: str, verifier_dir: Path, given: str | None, outtype: str,
                     cache: Path) -> Path:
    """The verifier's GGUF (`engines/llamacpp_convert.py verifier_gguf`), the embedded default's own file its own."""
    from ..engines.llamacpp_convert import verifier_gguf
    from ..verifier.loading import DEFAULT_VERIFIER, default_verifier_gguf

    own = default_verifier_gguf() if verifier in (DEFAULT_VERIFIER, "default") else None
    return verifier_gguf(build, verifier_dir, given, outtype, cache, own)


def refuse_for_llamacpp(drafter: str, verifier_dir: Path, revision: str | None, consequence: str = "") -> None:
    """llama.cpp's rules (check --engine llamacpp) before any conversion or server: each error printed as its own
    line, then one UsageError."""
    from .check import check_drafter

    errors = [f for f in check_drafter(drafter, verifier=str(verifier_dir), engine="llamacpp", revision=revision)
              if f.level == "error"]
    if errors:
        for finding in errors:
            print(f"  {finding}", file=sys.stderr)
        raise UsageError(f"{drafter} would not convert or serve correctly in llama.cpp ({len(errors)} error(s) "
                         f"above, `eagle3-hf check --engine llamacpp`){consequence}")


def export_gguf(args: argparse.Namespace) -> tuple[Path, Path]:
    """(drafter GGUF, verifier GGUF), after llama.cpp's rules passed: each error they find is printed as its own
    line and the export refused before any conversion."""
    from ..engines.llamacpp_env import find_llamacpp

    if not args.verifier:
        raise UsageError("--format gguf needs --verifier: llama.cpp's converter reads the verifier's config and "
                         "tokenizer (--target-model-dir)")
    verifier_dir = local_verifier_dir(args.verifier, args.verifier_gguf)
    refuse_for_llamacpp(args.drafter, verifier_dir, args.revision, "; nothing was converted")
    build = find_llamacpp(need_server=False)  # after the rules: they need no build
    out = Path(args.output)
    kind = drafter_kind_of(args.drafter, args.revision)
    drafter = drafter_gguf(build, args.drafter, verifier_dir,
                           out / GGUF_DRAFTER.format(kind=kind.name, outtype=args.gguf_type), args.gguf_type,
                           revision=args.revision)
    verifier = verifier_gguf_of(build, args.verifier, verifier_dir, args.verifier_gguf, args.gguf_type, out)
    return drafter, verifier


def dflash_drafts(drafter: str, revision: str | None) -> int:
    """A DFlash drafter's drafts per block, block_size - 1 (llama.cpp clamps --spec-draft-n-max to it)."""
    import json

    from ..model.checkpoint import resolve_checkpoint

    raw = json.loads((resolve_checkpoint(drafter, revision=revision) / "config.json").read_text())
    return int((raw.get("dflash_config") or {}).get("block_size") or raw.get("block_size") or 16) - 1


def run(args: argparse.Namespace) -> int:
    dflash = drafter_kind_of(args.drafter, args.revision) is not EAGLE3
    if args.format == "gguf":
        drafter_file, verifier_file = export_gguf(args)
        kind = drafter_kind_of(args.drafter, args.revision)
        drafts = dflash_drafts(args.drafter, args.revision) if dflash else 3
        print(f"wrote {drafter_file} (verifier: {verifier_file}); serve it with\n  llama-server -m {verifier_file} "
              f"-md {drafter_file} --spec-type {kind.llamacpp_spec_type} --spec-draft-n-max {drafts} "
              "--spec-draft-p-min 0")
        return 0
    if dflash:
        raise UsageError(f"{args.drafter} is a DFlash drafter: its directory is already the layout vLLM, SGLang and "
                         "llama.cpp's converter read (--format gguf converts it); --format standard and speculators "
                         "are EAGLE-3 layouts")
    from ..model.modeling_eagle3 import Eagle3DraftModel
    from ..verifier.loading import load_verifier

    verifier = load_verifier(args.verifier) if args.verifier else None
    model = Eagle3DraftModel.from_pretrained(args.drafter, revision=args.revision, verifier=verifier,
                                             dtype=PUSH_DTYPES.get(args.dtype, args.dtype))
    if args.format == "speculators":
        if verifier is None and not model.embed_tokens_loaded:
            raise UsageError("--format speculators needs --verifier (the layout carries the verifier's embedding)")
        model.save_speculators(args.output, verifier=verifier)
    else:
        model.save_pretrained(args.output, include_embed_tokens=args.include_embed_tokens)
    print(f"wrote the {args.format} layout to {args.output}")
    return 0
