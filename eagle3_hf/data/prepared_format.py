"""The prepared dataset on disk: `datasets.save_to_disk` plus a meta file (tokenizer fingerprint, the tokenizer's
class and --trust-remote-code, options, counts). `prepare` and `regenerate --prepared-out` write it; extraction,
vocab, online training and the importers read it, only through this module, which refuses a directory without meta
or samples, one made with another tokenizer (or another tokenizer class), missing columns and repeated ids by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..constants import PREPARE_META

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase


def save_prepared(ds: datasets.Dataset, out_dir: str | Path, meta: dict) -> Path:
    """`save_to_disk` + meta, replacing an earlier prepare output atomically; refuses to clobber other dirs."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not (out / PREPARE_META).is_file():
        raise FileExistsError(f"{out} exists, is not empty and is not a prepare output; choose another --output")
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    ds.save_to_disk(str(tmp))
    (tmp / PREPARE_META).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    if out.exists():
        shutil.rmtree(out)  # an older dataset (and any vocab built from it) is stale now
    tmp.rename(out)
    return out


def read_prepared_meta(path: str | Path) -> dict:
    """The meta of a prepared dataset directory; a directory without it is refused by name."""
    meta_path = Path(path) / PREPARE_META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path}: not a prepared dataset (no {PREPARE_META}); run `eagle3-hf prepare`")
    return json.loads(meta_path.read_text(encoding="utf-8"))


def load_prepared(path: str | Path, tokenizer_fingerprint: str | None = None,
                  tokenizer: PreTrainedTokenizerBase | None = None) -> tuple[datasets.Dataset, dict]:
    """The prepared Dataset and its meta, checked: refuses a directory without meta or samples, one made
    with another tokenizer (when `tokenizer_fingerprint` is given) or another tokenizer class (when `tokenizer`
    is), missing columns and repeated ids."""
    import datasets

    meta = read_prepared_meta(path)
    if tokenizer is not None:
        from .fingerprint import check_tokenizer_class, recorded_tokenizer

        check_tokenizer_class(recorded_tokenizer(meta), tokenizer, str(Path(path) / PREPARE_META))
    check_fingerprint(path, meta, tokenizer_fingerprint)
    refuse_empty(path, meta)
    ds = datasets.load_from_disk(str(path))
    refuse_empty(path, meta, len(ds))
    check_prepared(ds, str(path))
    return ds, meta


def check_fingerprint(path: str | Path, meta: dict, tokenizer_fingerprint: str | None) -> None:
    """Refuse a prepared directory (its `meta`) made with another tokenizer than `tokenizer_fingerprint` (None: any)."""
    found = meta.get("tokenizer_fingerprint")
    if tokenizer_fingerprint is not None and found != tokenizer_fingerprint:
        raise ValueError(
            f"{Path(path) / PREPARE_META}: prepared with tokenizer {found}, but the verifier's tokenizer is "
            f"{tokenizer_fingerprint}; re-run `eagle3-hf prepare` with this verifier"
        )


def open_prepared(prepared: datasets.Dataset | str | Path,
                  tokenizer_fingerprint: str | None = None) -> datasets.Dataset:
    """A prepared `datasets.Dataset` given as itself or as its directory (then `load_prepared` checks it)."""
    from datasets import Dataset

    if not isinstance(prepared, Dataset):
        return load_prepared(prepared, tokenizer_fingerprint)[0]
    if len(prepared) == 0:
        raise ValueError("the prepared dataset has 0 samples")
    check_prepared(prepared, "the prepared dataset")
    return prepared


def check_prepared(ds: datasets.Dataset, where: str) -> None:
    """The columns every reader needs, and sample ids that are unique (splits and shards key on them)."""
    missing = [c for c in ("id", "input_ids", "loss_mask") if c not in ds.column_names]
    if missing:
        raise ValueError(f"{where}: missing column(s) {missing} (has {ds.column_names})")
    ids = ds["id"]
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        for dup in ids:  # the first id seen before
            if dup in seen:
                break
            seen.add(dup)
        raise ValueError(f"{where}: sample id {dup!r} appears more than once")


def prepared_lengths(ds: datasets.Dataset) -> list[int]:
    """Token count of every row, read from the Arrow list offsets (no row is decoded)."""
    import pyarrow.compute as pc

    if getattr(ds, "_indices", None) is not None:
        ds = ds.flatten_indices()
    return pc.list_value_length(ds.data.column("input_ids")).to_numpy(zero_copy_only=False).tolist()


def refuse_empty(path: str | Path, meta: dict, num_rows: int | None = None) -> None:
    """An empty prepared dataset is refused by name (datasets itself fails on one with an IndexError)."""
    samples = meta.get("counts", {}).get("samples") if num_rows is None else num_rows
    state = Path(path) / "state.json"
    no_files = num_rows is None and state.is_file() and not json.loads(state.read_text()).get("_data_files")
    if samples == 0 or no_files:
        skipped = meta.get("counts", {}).get("skipped") or {}
        why = f" (skipped: {skipped_text(skipped)})" if skipped else ""
        raise ValueError(f"prepared dataset {path} has 0 samples{why}; re-run `eagle3-hf prepare` with other input")


def skipped_text(skipped: dict) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in skipped.items())
