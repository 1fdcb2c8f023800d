"""The one write loop of every offline route: this rank's slice of a prepared dataset, through a `FeatureSource`,
into the store's shards. `FeatureSink` is its end: the writer, skips, progress, summary (`ExtractionSummary`) and
the one merge; `import-features` and the routes that generate their samples (regenerate --features-out) write
through it too.

Rank slice (samples i with i % world_size == rank, under `torchrun` / `accelerate launch`), resumption (samples a
journal already holds are not asked for again), empty samples and samples longer than the route takes recorded
as skipped ("empty", "overlong": counted in the summary, their ids in the manifest's skipped_ids), progress in
tokens, the writer closed whatever happens, then rank 0 merges every rank's journal into manifest.json once
every sample is accounted for. Killed at any point, the same command resumes (store.py says why nothing is lost
or duplicated).

One length rule for every route (`sample_token_limit`): with `--max-model-len M` a sample of at most M - 1
tokens is extracted. vLLM needs that one free position (it refuses a prompt as long as its context, since it
must generate a token), and the transformers route keeps the same samples so that both routes' directories hold
the same ones for the same command line. A longer sample is skipped alone; the rank goes on.

Over several nodes that merge reads every node's journals, so the output directory must be shared: `extract`
checks that at launch (features/commands/extract.py), or, with `--per-node-output` on directories local to each
node, this loop has each node's first process merge its own node's ranks into a node part (a manifest with
`node_part`), which `train --per-node-features` reads on every node.
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import nodes
from ..data.prepared_samples import PreparedDataset
from .interface import CapturedSource, FeatureSource, SampleFeatures
from .records import FeatureHeader, NodePart
from .shard_writer import ShardWriter
from .store import dist_env, wait_and_merge

if TYPE_CHECKING:
    import datasets

MERGE_TIMEOUT_S = 48 * 3600  # rank 0 waits this long for the other ranks' journals
OVERLONG = "overlong"  # the skip reason of a sample longer than the route takes


def sample_token_limit(max_model_len: int | None) -> int | None:
    """The most tokens a sample may have under `--max-model-len` (module docstring); None: no limit."""
    if max_model_len is None:
        return None
    if max_model_len < 2:
        raise ValueError(f"--max-model-len {max_model_len}: a sample needs its tokens and one position more")
    return int(max_model_len) - 1


@dataclass
class StoreOptions:
    """How the shards are cut, and how many are written at once (ShardWriter's `writers`)."""

    samples_per_shard: int = 64
    max_shard_bytes: int = 1 << 30
    writers: int = 1


@dataclass
class ExtractionSummary:
    """What one rank's extraction did; printed by `extract` as one JSON line."""

    rank: int
    world_size: int
    written_samples: int
    written_tokens: int
    resumed_past: int
    skipped: dict[str, int]  # this run's: reason ("empty", "overlong", "nan_or_inf") -> samples
    seconds: float
    tokens_per_s: float | None
    route: dict[str, Any] = field(default_factory=dict)  # the source's own report (engine, version, load time)
    max_sample_tokens: int | None = None  # the longest sample this route takes (None: any)
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


def skip_reason(length: int, limit: int | None) -> str | None:
    """Why a sample of `length` tokens is not extracted, or None."""
    if length == 0:
        return "empty"
    if limit is not None and length > limit:
        return OVERLONG
    return None


def add_features(writer: ShardWriter, feats: SampleFeatures) -> bool:
    """Queue one route's sample: as the route stored it where it did (SampleFeatures.stored), else rounded here; a
    sample the route skipped (SampleFeatures.skip_reason) is recorded as skipped. False: not written."""
    sid = feats.sample.sample_id
    if feats.skip_reason is not None:
        writer.skip(sid, feats.skip_reason)
        return False
    if feats.stored is not None:
        writer.add_stored(sid, feats.stored, feats.stored_sha256)
        return True
    return writer.add(sid, feats.sample.input_ids, feats.sample.loss_mask, feats.aux_hidden_states,
                      feats.last_hidden_state, feats.verifier_greedy)


class FeatureSink:
    """Where every offline route's samples go: one rank's `ShardWriter` (its journal, resumption through
    `done_ids`), the skips and their counts, the progress bar, and at `finish` the summary, the barrier between
    ranks and the one merge of the journals into manifest.json. `write_features` feeds it from a `FeatureSource`;
    the generation routes, which only know their samples once generated, feed it themselves."""

    def __init__(self, out_dir: str | Path, header: FeatureHeader, *, store: StoreOptions | None = None,
                 rank: int = 0, world_size: int = 1) -> None:
        store = store or StoreOptions()
        self.out_dir, self.rank, self.world_size = Path(out_dir), rank, world_size
        self.writer = ShardWriter(out_dir, header, rank=rank, samples_per_shard=store.samples_per_shard,
                                  max_shard_bytes=store.max_shard_bytes, writers=store.writers)
        self.bar: Any = None
        self.unit = "tok"
        self.start = time.perf_counter()  # the summary's clock: until `finish`
        # what other processes' writers did (transformers_generation's spawned workers), added to this one's
        self.others: dict[str, Any] = {"samples": 0, "tokens": 0, "skipped": {}}

    @property
    def done_ids(self) -> set[str]:
        """Samples written or skipped by any rank before (and during) this run."""
        return self.writer.done_ids

    def progress(self, desc: str, total: int | None = None, unit: str = "tok", enabled: bool = True) -> None:
        """Show a bar: in tokens written (unit "tok") or samples (any other unit)."""
        from tqdm.auto import tqdm

        self.unit = unit
        self.bar = tqdm(total=total, unit=unit, unit_scale=unit == "tok", desc=desc, disable=not enabled,
                        dynamic_ncols=True)

    def skip(self, sample_id: str, reason: str) -> None:
        self.writer.skip(sample_id, reason)

    def add(self, feats: SampleFeatures) -> bool:
        """Write (queue) one sample, or record its skip; False when it was not written."""
        written = add_features(self.writer, feats)
        if self.bar is not None and feats.skip_reason is None:
            self.bar.update(feats.sample.input_ids.numel() if self.unit == "tok" else 1)
            if self.unit == "tok":
                self.bar.set_postfix(skipped=sum(self.writer.skipped_counts.values()), refresh=False)
        return written

    def count_others(self, samples: int, tokens: int, skipped: dict[str, int]) -> None:
        """Add what another process's writer of the same directory wrote and skipped to this summary."""
        self.others["samples"] += samples
        self.others["tokens"] += tokens
        for reason, n in skipped.items():
            self.others["skipped"][reason] = self.others["skipped"].get(reason, 0) + n

    def close(self) -> None:
        """Commit what is pending (whatever happened); again: nothing more."""
        try:
            self.writer.close()
        finally:
            if self.bar is not None:
                self.bar.close()

    def __enter__(self) -> FeatureSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def finish(self, all_ids: list[str], *, resumed_past: int, route: dict[str, Any] | None = None,
               max_sample_tokens: int | None = None,
               merge_timeout_s: float | None = MERGE_TIMEOUT_S) -> ExtractionSummary:
        """The summary of this run; then, once every rank is here, rank 0 (or each node's first process, with
        --per-node-output) merges the journals of the dataset `all_ids` into manifest.json."""
        self.close()
        elapsed = time.perf_counter() - self.start
        writer, others = self.writer, self.others
        skipped = dict(writer.skipped_counts)
        for reason, n in others["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
        samples, tokens = writer.written_samples + others["samples"], writer.written_tokens + others["tokens"]
        summary = ExtractionSummary(self.rank, self.world_size, samples, tokens, resumed_past, skipped,
                                    round(elapsed, 3), round(tokens / elapsed, 1) if elapsed > 0 else None,
                                    dict(route or {}), max_sample_tokens=max_sample_tokens)
        if skipped.get(OVERLONG):
            limit = max_sample_tokens
            print(f"[extract] rank {self.rank}: skipped {skipped[OVERLONG]} samples of more than {limit} tokens "
                  f"(a context of {limit} + 1 positions, one for the generated token): prepare with --max-seq-len "
                  f"{limit}, or extract with a longer --max-model-len; their ids: {self.out_dir}/manifest.json "
                  f"skipped_ids.{OVERLONG}", file=sys.stderr)
        if self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        layout = nodes.node_local(self.out_dir)
        if layout is not None:  # a directory local to this node: its first process merges the node's ranks
            if layout.local_rank == 0:
                summary.node_part = node_part(layout, all_ids)
                ranks = set(layout.node_ranks[layout.node])
                node_ids = [sid for i, sid in enumerate(all_ids) if i % self.world_size in ranks]
                manifest = wait_and_merge(self.out_dir, node_ids, merge_timeout_s, node_part=summary.node_part)
                summary.total_samples, summary.total_skipped = len(manifest["samples"]), manifest["skipped"]
        elif self.rank == 0:
            manifest = wait_and_merge(self.out_dir, all_ids, merge_timeout_s)
            summary.total_samples, summary.total_skipped = len(manifest["samples"]), manifest["skipped"]
        return summary


def write_features(source: FeatureSource, prepared: PreparedDataset, out_dir: str | Path, *,
                   store: StoreOptions | None = None, rank: int | None = None, world_size: int | None = None,
                   progress: bool = True, desc: str = "extract",
                   merge_timeout_s: float | None = MERGE_TIMEOUT_S) -> ExtractionSummary:
    """Write `source`'s features for this rank's slice of `prepared` (the samples as training opens them,
    `PreparedDataset(path, "all", tokenizer_fingerprint=...)`, checked against the source's tokenizer when
    opened) to `out_dir`. Samples not checked against the source's tokenizer, and appending to a directory written
    with another identity (verifier, tokenizer, aux layers, dtype, capture path), are refused."""
    env_rank, env_world = dist_env()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    if prepared.tokenizer_fingerprint != source.identity.tokenizer_fingerprint:
        raise ValueError(f"{prepared.path or 'the prepared samples'}: opened for tokenizer "
                         f"{prepared.tokenizer_fingerprint}, but the route's tokenizer is "
                         f"{source.identity.tokenizer_fingerprint}; open them with PreparedDataset(..., "
                         "tokenizer_fingerprint=<the route's>), which refuses samples another tokenizer prepared")
    all_ids = list(prepared.sample_ids)
    mine = range(rank, len(prepared), world_size)
    lengths = prepared.lengths

    limit = source.check([lengths[i] for i in mine])  # before anything is written, done samples included
    header = source.identity.header()
    header.update(prepared.tokenizer_record())  # type: ignore[typeddict-item]  # the class that tokenized the data
    sink = FeatureSink(out_dir, header, store=store, rank=rank, world_size=world_size)
    with sink:
        todo = [i for i in mine if all_ids[i] not in sink.done_ids]
        skip = {i: skip_reason(lengths[i], limit) for i in todo}
        submit = [i for i in todo if skip[i] is None]
        sink.progress(f"{desc} r{rank}", int(sum(lengths[i] for i in submit)), enabled=progress)
        sink.start = time.perf_counter()
        for i in todo:
            reason = skip[i]
            if reason is not None:
                sink.skip(all_ids[i], reason)
        if submit:
            for feats in source.states(prepared.samples(submit)):
                sink.add(feats)
    return sink.finish(all_ids, resumed_past=len(mine) - len(todo), route=source.report(), max_sample_tokens=limit,
                       merge_timeout_s=merge_timeout_s)


def node_part(layout: nodes.NodeLayout, all_ids: list[str]) -> NodePart:
    """The manifest's record of this node's part of the dataset `all_ids`."""
    digest = hashlib.sha256("\n".join(all_ids).encode("utf-8")).hexdigest()
    return NodePart(node=layout.node, nodes=layout.nodes, host=layout.host, dataset_samples=len(all_ids),
                    dataset_ids_sha256=digest)


def import_features(source: CapturedSource, out_dir: str | Path, *,
                    prepared: datasets.Dataset | str | Path | None = None, store: StoreOptions | None = None,
                    progress: bool = True) -> ExtractionSummary:
    """Import a capture written by another tool (speculators, SpecForge) into `out_dir` in its own order
    (resumable like extraction). `prepared` (our prepared dataset) gives imported samples our ids, matched by
    tokens."""
    sink = FeatureSink(out_dir, source.identity.header(), store=store)
    all_ids: list[str] = []
    resumed = 0
    with sink:
        sink.progress(f"import {source.fmt}", unit="sample", enabled=progress)
        for sample in source.captured(prepared):
            all_ids.append(sample.sample_id)
            if sample.sample_id in sink.done_ids:
                resumed += 1
                continue
            for feats in source.states([sample]):
                sink.add(feats)
    return sink.finish(all_ids, resumed_past=resumed, route=source.report())
