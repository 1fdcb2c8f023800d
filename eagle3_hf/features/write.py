"""The one write loop of every offline route: this rank's slice of a prepared dataset, through a `FeatureSource`,
into the store's shards.

Rank slice (samples i with i % world_size == rank, under `torchrun` / `accelerate launch`), resumption (samples a
journal already holds are not asked for again), empty samples recorded as skipped, progress in tokens, the
writer closed whatever happens, then rank 0 merges every rank's journal into manifest.json once every sample is
accounted for. Killed at any point, the same command resumes (store.py says why nothing is lost or duplicated).

Over several nodes that merge reads every node's journals, so the output directory must be shared:
`check_output_shared` says so at launch, or, with `--per-node-output` on directories local to each node, has
each node's first process merge its own node's ranks into a node part (a manifest with `node_part`), which
`train --per-node-features` reads on every node.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import nodes
from ..data.prepared_format import open_prepared, prepared_lengths
from ..errors import UsageError
from .records import NodePart
from .source import FeatureSource, PreparedSample
from .store import ShardWriter, dist_env, wait_and_merge

if TYPE_CHECKING:
    import datasets

MERGE_TIMEOUT_S = 48 * 3600  # rank 0 waits this long for the other ranks' journals


@dataclass
class StoreOptions:
    """How the shards are cut."""

    samples_per_shard: int = 64
    max_shard_bytes: int = 1 << 30


@dataclass
class ExtractionSummary:
    """What one rank's extraction did; printed by `extract` as one JSON line."""

    rank: int
    world_size: int
    written_samples: int
    written_tokens: int
    resumed_past: int
    skipped: dict[str, int]
    seconds: float
    tokens_per_s: float | None
    route: dict[str, Any] = field(default_factory=dict)  # the source's own report (engine, version, load time)
    total_samples: int | None = None  # rank 0 (a node's first process: its node's), after the merge
    total_skipped: dict[str, Any] | None = None
    node_part: NodePart | None = None  # what a node's first process merged (--per-node-output)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "route"}
        if self.total_samples is None:
            del out["total_samples"], out["total_skipped"]
        if self.node_part is None:
            del out["node_part"]
        return {**self.route, **out}


class PreparedRows(Sequence[PreparedSample]):
    """Rows `index` of a prepared dataset, read when asked for (a route may hold only a few at a time)."""

    def __init__(self, rows: Any, ids: list[str], positions: list[int]):
        self.rows, self.ids, self.positions = rows, ids, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, k: int) -> PreparedSample:  # type: ignore[override]  # no slices
        row = self.rows[self.positions[k]]
        return PreparedSample(self.ids[self.positions[k]], row["input_ids"].long(), row["loss_mask"])


def write_features(source: FeatureSource, prepared: datasets.Dataset | str | Path, out_dir: str | Path, *,
                   store: StoreOptions | None = None, rank: int | None = None, world_size: int | None = None,
                   progress: bool = True, desc: str = "extract",
                   merge_timeout_s: float | None = MERGE_TIMEOUT_S) -> ExtractionSummary:
    """Write `source`'s features for this rank's slice of `prepared` to `out_dir`. Appending to a directory
    written with another identity (verifier, tokenizer, aux layers, dtype, capture path) is refused."""
    from tqdm.auto import tqdm

    store = store or StoreOptions()
    env_rank, env_world = dist_env()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    out_dir = Path(out_dir)
    ds = open_prepared(prepared, source.identity.tokenizer_fingerprint)
    all_ids = list(ds["id"])
    mine = range(rank, len(ds), world_size)
    lengths = prepared_lengths(ds)
    rows = ds.with_format("torch", columns=["input_ids", "loss_mask"])

    source.check([lengths[i] for i in mine])  # before anything is written, done samples included
    writer = ShardWriter(out_dir, source.identity.header(), rank=rank, samples_per_shard=store.samples_per_shard,
                         max_shard_bytes=store.max_shard_bytes)
    todo = [i for i in mine if all_ids[i] not in writer.done_ids]
    submit = [i for i in todo if lengths[i] > 0]
    bar = tqdm(total=int(sum(lengths[i] for i in submit)), unit="tok", unit_scale=True, desc=f"{desc} r{rank}",
               disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    try:
        for i in todo:
            if lengths[i] == 0:
                writer.skip(all_ids[i], "empty")
        if submit:
            for feats in source.states(PreparedRows(rows, all_ids, submit)):
                writer.add(feats.sample.sample_id, feats.sample.input_ids, feats.sample.loss_mask,
                           feats.aux_hidden_states, feats.last_hidden_state, feats.verifier_greedy)
                bar.update(feats.sample.input_ids.numel())
                bar.set_postfix(skipped=sum(writer.skipped_counts.values()), refresh=False)
    finally:
        writer.close()
        bar.close()
    elapsed = time.perf_counter() - start
    summary = ExtractionSummary(rank, world_size, writer.written_samples, writer.written_tokens, len(mine) - len(todo),
                                dict(writer.skipped_counts), round(elapsed, 3),
                                round(writer.written_tokens / elapsed, 1) if elapsed > 0 else None, source.report())
    if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    layout = nodes.node_local(out_dir)
    if layout is not None:  # a directory local to this node: its first process merges the node's ranks
        if layout.local_rank == 0:
            summary.node_part = node_part(layout, all_ids)
            ranks = set(layout.node_ranks[layout.node])
            node_ids = [sid for i, sid in enumerate(all_ids) if i % world_size in ranks]
            manifest = wait_and_merge(out_dir, node_ids, merge_timeout_s, node_part=summary.node_part)
            summary.total_samples, summary.total_skipped = len(manifest["samples"]), manifest["skipped"]
    elif rank == 0:
        manifest = wait_and_merge(out_dir, all_ids, merge_timeout_s)
        summary.total_samples, summary.total_skipped = len(manifest["samples"]), manifest["skipped"]
    return summary


def node_part(layout: nodes.NodeLayout, all_ids: list[str]) -> NodePart:
    """The manifest's record of this node's part of the dataset `all_ids`."""
    digest = hashlib.sha256("\n".join(all_ids).encode("utf-8")).hexdigest()
    return NodePart(node=layout.node, nodes=layout.nodes, host=layout.host, dataset_samples=len(all_ids),
                    dataset_ids_sha256=digest)


def check_output_shared(out_dir: str | Path, per_node: bool) -> None:
    """At launch, before any verifier is loaded: over several nodes, rank 0's merge reads every node's journals,
    so `out_dir` must be one directory for all of them. Not shared: refused in one line, or with `per_node`
    (each node's own local directory) each node's first process merges its own node's ranks
    (`write_features`). Shared, `per_node` changes nothing: rank 0 merges everything."""
    if not nodes.multi_node():
        return
    with nodes.ProcessGroup():
        layout = nodes.gather_layout()
        views = nodes.check_shared(out_dir, layout)
    seen = views[layout.rank]
    if min(views) == layout.nodes:
        return
    if not per_node:
        raise UsageError(nodes.not_shared(
            "extract --output", out_dir, layout, seen, "use a shared filesystem, or --per-node-output to have "
            "each node merge its own ranks' shards into a node part (`train --per-node-features` reads the parts)"))
    if max(views) > 1:  # some nodes share it, others do not: their node parts would overwrite one another
        raise UsageError(nodes.not_shared(
            "extract --output", out_dir, layout, seen, "--per-node-output needs a directory local to each node "
            "or one shared by all; some nodes share this one"))
    nodes.remember_node_local(out_dir, layout)
