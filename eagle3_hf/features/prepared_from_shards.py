"""The prepared dataset (`eagle3-hf prepare`'s output: ids, loss mask, meta) read back from feature shards:
`regenerate --features-out --prepared-out` writes it from the tokens its one verifier pass stored, so `vocab` and
`train --prepared-dir` see exactly the tokens the features were computed on."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.prepared_format import save_prepared
from .records import SampleRecord
from .store import load_manifest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def write_prepared(features_out: Path, out_dir: Path, tokenizer: PreTrainedTokenizerBase, tokenizer_name: str,
                   order: list[str], options: dict[str, Any]) -> dict[str, Any]:
    """`prepare`'s output for the samples in `features_out` (input_ids + loss_mask read back from the shards),
    in input order; its meta counts refusals as prepare counts skips."""
    import datasets
    from safetensors import safe_open

    from ..data.prepare import build_meta, new_stats

    manifest = load_manifest(features_out)
    by_shard: dict[str, list[SampleRecord]] = {}
    for s in manifest["samples"]:
        by_shard.setdefault(s["shard"], []).append(s)
    rows: dict[str, tuple[list[int], list[int]]] = {}
    for shard, samples in by_shard.items():
        with safe_open(str(features_out / shard), framework="pt") as f:
            ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
        for s in samples:
            a, b = s["offset"], s["offset"] + s["length"]
            rows[s["id"]] = (ids[a:b].tolist(), mask[a:b].tolist())
    rank = {sid: i for i, sid in enumerate(order)}
    keys = sorted(rows, key=lambda sid: (rank.get(sid, len(rank)), sid))
    stats = new_stats()
    stats.update(input=len(keys) + sum(manifest["skipped"].values()), samples=len(keys),
                 tokens=sum(len(rows[k][0]) for k in keys), loss_tokens=sum(sum(rows[k][1]) for k in keys))
    stats["skipped"].update(manifest["skipped"])
    stats["skipped_ids"].update(manifest["skipped_ids"])
    if not keys:
        raise ValueError(f"{features_out}: 0 samples to prepare (refused: {manifest['skipped']}); nothing written to "
                         f"{out_dir}")
    features = datasets.Features({"id": datasets.Value("string"),
                                  "input_ids": datasets.List(datasets.Value("int32")),
                                  "loss_mask": datasets.List(datasets.Value("int8"))})
    ds = datasets.Dataset.from_dict({"id": keys, "input_ids": [rows[k][0] for k in keys],
                                     "loss_mask": [rows[k][1] for k in keys]}, features=features)
    meta = build_meta(tokenizer, tokenizer_name, stats, options)
    save_prepared(ds, out_dir, meta)
    return meta
