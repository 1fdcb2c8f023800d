"""`eagle3-hf export`: rewrite a drafter (any supported layout, local or on the Hub) in the standard or
the speculators layout. The layouts themselves are defined in `eagle3_hf/model/checkpoint.py`."""

from __future__ import annotations

import argparse

from ..errors import UsageError
from .serving import PUSH_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="drafter directory or Hub repo id (any supported layout)")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--format", choices=["standard", "speculators"], default="standard")
    parser.add_argument("--verifier", help="verifier (name or path): its embedding fills embed_tokens")
    parser.add_argument("--include-embed-tokens", action="store_true",
                        help="standard layout: also write embed_tokens (engines normally take the verifier's)")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--dtype", default=None, choices=[*PUSH_DTYPES, *PUSH_DTYPES.values()],
                        help="the floating weights' dtype, as `push --dtype` (bf16 is what `push` uploads by "
                             "default; d2t and t2d keep theirs); default: the checkpoint's")


def run(args: argparse.Namespace) -> int:
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
