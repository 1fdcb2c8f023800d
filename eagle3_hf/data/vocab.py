"""The draft vocabulary: the N target ids the drafter can propose (docs/contracts.md, d2t / t2d).

Kept ids are the N most frequent *assistant* tokens (loss_mask = 1), ties broken by lower id so the
choice is deterministic, then sorted ascending, and turned into `d2t` / `t2d` by
`eagle3_hf.model.checkpoint.vocab_from_target_ids` (the mapping's one definition). The file carries the
tokenizer fingerprint and vocab size, and `load_vocab` refuses a mapping built for another tokenizer: an id map
from the wrong tokenizer trains and serves without error and is just quietly useless.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..constants import VOCAB_FILE
from ..model.checkpoint import validate_vocab_mapping, vocab_from_target_ids

if TYPE_CHECKING:
    import datasets



def token_counts(ds: datasets.Dataset, vocab_size: int) -> np.ndarray:
    """int64 [vocab_size] counts of assistant tokens, read from the Arrow columns without Python loops."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    if len(ds) == 0:
        return counts
    table = ds.with_format("arrow")[:]  # memory-mapped; no copy unless the dataset has an index mapping
    for batch in table.select(["input_ids", "loss_mask"]).to_batches():  # columns aligned per batch
        ids_col, mask_col = batch.column(0), batch.column(1)
        if not ids_col.value_lengths().equals(mask_col.value_lengths()):
            raise ValueError("input_ids and loss_mask lengths differ in a row of the prepared dataset")
        ids = ids_col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        mask = mask_col.flatten().to_numpy(zero_copy_only=False).astype(bool)
        kept = ids[mask]
        if kept.size and (kept.min() < 0 or kept.max() >= vocab_size):
            bad = int(kept.max()) if kept.max() >= vocab_size else int(kept.min())
            raise ValueError(f"token id {bad} outside vocab_size {vocab_size} (pass the verifier's --vocab-size)")
        counts += np.bincount(kept, minlength=vocab_size)
    return counts


def select_top_ids(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, int]:
    """Top-N ids (ties -> lower id), sorted ascending, and how many of them never occurred (fillers)."""
    vocab_size = len(counts)
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be in 1..{vocab_size}")
    order = np.argsort(-counts, kind="stable")  # stable: equal counts keep ascending id order
    kept = np.sort(order[:draft_vocab_size])
    return kept, int((counts[kept] == 0).sum())


def coverage(counts: np.ndarray, t2d: torch.Tensor) -> float:
    """Fraction of assistant tokens whose id the drafter can propose."""
    total = int(counts.sum())
    return float(counts[t2d.numpy()].sum() / total) if total else 0.0


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, fingerprint: str, coverage: float) -> Path:
    from safetensors.torch import save_file

    check_consistent(d2t, t2d, str(path))
    meta = {"tokenizer_fingerprint": fingerprint, "vocab_size": str(t2d.numel()),
            "draft_vocab_size": str(d2t.numel()), "coverage": f"{coverage:.6f}"}
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"d2t": d2t.to(torch.int64).contiguous(), "t2d": t2d.to(torch.bool).contiguous()}, str(tmp),
              metadata=meta)
    tmp.replace(path)
    return path


def check_consistent(d2t: torch.Tensor, t2d: torch.Tensor, where: str) -> None:
    """d2t must name exactly the ids t2d marks, strictly ascending (the checkpoint contract's own check)."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool or d2t.dim() != 1 or t2d.dim() != 1:
        raise ValueError(f"{where}: d2t must be int64 [N] and t2d bool [vocab], got {d2t.dtype} {list(d2t.shape)} "
                         f"and {t2d.dtype} {list(t2d.shape)}")
    try:
        validate_vocab_mapping(d2t, t2d, d2t.numel(), t2d.numel())
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def load_vocab(path: str | Path, expect_fingerprint: str | None = None,
               expect_vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(d2t, t2d, metadata); refuses a mapping for another tokenizer or vocab size, or an inconsistent one."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        keys = set(f.keys())
        if not {"d2t", "t2d"} <= keys:
            raise ValueError(f"{path}: needs tensors d2t and t2d, has {sorted(keys)}")
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    if expect_fingerprint is not None and meta.get("tokenizer_fingerprint") != expect_fingerprint:
        raise ValueError(f"{path}: built for tokenizer fingerprint {meta.get('tokenizer_fingerprint')!r}, "
                         f"expected {expect_fingerprint!r} (another tokenizer; rebuild with `eagle3-hf vocab`)")
    if expect_vocab_size is not None and t2d.numel() != expect_vocab_size:
        raise ValueError(f"{path}: built for vocab size {t2d.numel()}, expected {expect_vocab_size}")
    if "vocab_size" in meta and int(meta["vocab_size"]) != t2d.numel():
        raise ValueError(f"{path}: metadata vocab_size {meta['vocab_size']} != t2d size {t2d.numel()}")
    check_consistent(d2t, t2d, str(path))
    return d2t, t2d, meta


def build_vocab(ds: datasets.Dataset, vocab_size: int,
                draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(d2t, t2d, coverage, number of never-seen filler ids) from a prepared dataset."""
    counts = token_counts(ds, vocab_size)
    kept, fillers = select_top_ids(counts, draft_vocab_size)
    d2t, t2d = vocab_from_target_ids(kept, vocab_size)
    return d2t, t2d, coverage(counts, t2d), fillers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, help="directory written by `eagle3-hf prepare`")
    parser.add_argument("--draft-vocab-size", type=int, required=True)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="verifier vocab size (default: the tokenizer's, from the prepare meta); pass the "
                             "model's config.vocab_size when its embedding is padded beyond the tokenizer")
    parser.add_argument("--output", default=None, help=f"default: DATA/{VOCAB_FILE}")


def run(args: argparse.Namespace) -> int:
    from eagle3_hf.data.prepared_format import load_prepared

    ds, meta = load_prepared(args.data)
    vocab_size = args.vocab_size or int(meta["tokenizer_vocab_size"])
    d2t, t2d, cov, fillers = build_vocab(ds, vocab_size, args.draft_vocab_size)
    out = save_vocab(args.output or Path(args.data) / VOCAB_FILE, d2t, t2d, meta["tokenizer_fingerprint"], cov)
    if fillers:
        print(f"vocab: only {args.draft_vocab_size - fillers} distinct assistant tokens; filled {fillers} ids "
              f"by lowest id", file=sys.stderr)
    print(f"vocab: {args.draft_vocab_size}/{vocab_size} ids, coverage {cov:.4f} of assistant tokens -> {out}",
          file=sys.stderr)
    return 0
