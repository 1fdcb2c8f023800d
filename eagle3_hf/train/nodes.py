"""Training over several nodes: which of its directories must be shared, and each node training on its own part.

`check_training_nodes` runs at launch, before any data is read (eagle3_hf/nodes.py finds out what is shared):
- `--output-dir`: the best-model reload, a resume and the final save read what rank 0 wrote, so it is shared, or
  `--save_on_each_node` (transformers' own) keeps every checkpoint on each node's local disk, written by the node's
  first process, so that each node reloads its best checkpoint and resumes from its own copy. A shared directory
  with `--save_on_each_node` is refused: every node would write the same files. DeepSpeed partitions its
  checkpoints over the ranks, so there the directory must be shared.
- `--cache-features`: every rank's journal is merged at the end: shared.
- `--features DIR`: every node must read the same features (a shared directory or a copy), or, with
  `--per-node-features`, the node parts of one extraction (`extract --per-node-output`): then each node trains on
  its own part through `NodeRows` and `NodeSampler`, with no copy of the other nodes' shards.
The draft vocabulary must be the same on every node (`check_same_vocabulary`): one model.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, Sampler

from .. import nodes
from ..constants import MANIFEST
from ..errors import UsageError
from .arguments import DataArguments

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from ..features.packing import PackedDataset
    from ..features.records import NodePart
    from .arguments import Eagle3TrainingArguments

logger = logging.getLogger("eagle3_hf.train")


@dataclass(frozen=True)
class TrainingNodes:
    """What the launch check found: the layout, and whether each node reads its own part of the features."""

    layout: nodes.NodeLayout
    parts: bool


def check_training_nodes(data_args: DataArguments, args: Eagle3TrainingArguments) -> TrainingNodes | None:
    """The launch check of a multi-node run (None on one node); every rank raises the same one-line error."""
    if not nodes.multi_node():
        return None
    assert args.output_dir is not None  # parse_args refuses a run without --output-dir
    args.world_size  # noqa: B018 - TrainingArguments set up the process group (the check gathers over it)
    layout = nodes.gather_layout()
    if layout.nodes == 1:
        return None
    views = nodes.check_shared(args.output_dir, layout)
    seen, shared = views[layout.rank], min(views) == layout.nodes
    if shared and args.save_on_each_node:
        raise UsageError(f"--save_on_each_node with --output-dir {args.output_dir} shared by all {layout.nodes} "
                         "nodes: every node would write the same checkpoint files; drop --save_on_each_node")
    if not shared and not args.save_on_each_node:
        raise UsageError(nodes.not_shared(
            "--output-dir", args.output_dir, layout, seen, "use a shared filesystem, or --save_on_each_node to keep "
            "every checkpoint, the best model and the final drafter on each node"))
    if not shared and (args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"):
        raise UsageError(nodes.not_shared(
            "--output-dir", args.output_dir, layout, seen, "DeepSpeed partitions its checkpoints over the ranks, "
            "so resuming reads them all: use a shared filesystem, or DDP "
            "(accelerate_configs/multinode_ddp_template.yaml) with --save_on_each_node"))
    if not shared and max(views) > 1:
        raise UsageError(nodes.not_shared("--output-dir", args.output_dir, layout, seen,
                                          "--save_on_each_node needs a directory local to each node or one "
                                          "shared by all; some nodes share this one"))
    if data_args.cache_features:
        cache_views = nodes.check_shared(data_args.cache_features, layout)
        if min(cache_views) < layout.nodes:
            raise UsageError(nodes.not_shared("--cache-features", data_args.cache_features, layout,
                                              cache_views[layout.rank], "use a shared filesystem (rank 0 merges "
                                              "every rank's journal at the end)"))
    parts = False
    if data_args.features and feature_directory(data_args.features):
        parts = check_feature_parts(data_args.features, layout, data_args)
    elif data_args.per_node_features:
        raise UsageError(f"--per-node-features reads a feature directory on each node; --features "
                         f"{data_args.features} is computed while training")
    if not shared:
        logger.info("--output-dir %s is local to each node: node %d of %d (%s) keeps its own checkpoints "
                    "(--save_on_each_node)", args.output_dir, layout.node, layout.nodes, layout.host)
    return TrainingNodes(layout, parts)


def feature_directory(features: str) -> bool:
    from ..features.table import FeatureSpec

    return not FeatureSpec.parse(features).online


def check_feature_parts(features: str, layout: nodes.NodeLayout, data_args: DataArguments) -> bool:
    """False when every node reads the same manifest (a shared directory, or the same copy); True when, with
    --per-node-features, the nodes hold the parts of one extraction; any other case is one line."""
    from ..features.store import read_manifest

    differs = nodes.same_everywhere(f"--features {features}", nodes.file_digest(Path(features) / MANIFEST), layout)
    if differs is None:
        return False
    if not data_args.per_node_features:
        raise UsageError(f"{differs}: use a shared filesystem or the same copy on every node, or --per-node-features "
                         "where each node holds its part of the extraction (`extract --per-node-output`)")
    try:
        manifest = read_manifest(features)
        part: NodePart | None = manifest.get("node_part")
        held = len(manifest["samples"]) + sum(int(n) for n in manifest.get("skipped", {}).values())
    except (OSError, ValueError):
        part, held = None, 0
    problem = parts_problem(nodes.all_gather((layout.node, part, held)), layout)
    if problem:
        raise UsageError(f"--per-node-features {features}: {problem}")
    if data_args.max_train_tokens is not None:
        raise UsageError("--max-train-tokens with --per-node-features: each node would cap its own part; train on "
                         "a subset extracted as one, or drop --max-train-tokens")
    logger.info("--per-node-features: node %d of %d (%s) trains on its part of the extraction in %s", layout.node,
                layout.nodes, layout.host, features)
    return True


def parts_problem(views: Sequence[tuple[int, Any, int]], layout: nodes.NodeLayout) -> str | None:
    """What keeps every rank's (node, node part, samples held) from being the parts of one extraction, one per
    node; None when they are."""
    by_node: dict[int, tuple[Any, int]] = {}
    for rank, (node, part, held) in enumerate(views):
        host = layout.hosts[node]
        if part is None:
            return (f"rank {rank} on host {host} reads no node part there (a whole extraction, or none): write "
                    "each node's part with `extract --per-node-output`, or train on one shared directory")
        if by_node.setdefault(node, (part, held)) != (part, held):
            return f"the ranks of host {host} read different parts"
    first = by_node[0][0]
    for node, (part, _) in sorted(by_node.items()):
        if part["nodes"] != layout.nodes:
            return (f"host {layout.hosts[node]} holds part {part['node']} of {part['nodes']} nodes; this run has "
                    f"{layout.nodes} nodes")
        if part["dataset_ids_sha256"] != first["dataset_ids_sha256"]:
            return f"hosts {layout.hosts[0]} and {layout.hosts[node]} hold parts of different prepared datasets"
    indices = sorted(part["node"] for part, _ in by_node.values())
    if indices != list(range(layout.nodes)):
        return f"the nodes hold parts {indices}, not each of 0..{layout.nodes - 1} once"
    held = sum(h for _, h in by_node.values())
    if held != first["dataset_samples"]:
        return (f"the parts hold {held} samples, the dataset has {first['dataset_samples']} (a part not finished: "
                "rerun that node's extraction)")
    return None


def check_same_vocabulary(d2t: torch.Tensor, layout: nodes.NodeLayout) -> None:
    """One model over every node: the draft vocabulary each node loaded must be the same."""
    digest = hashlib.sha256(d2t.to(torch.int64).numpy().tobytes()).hexdigest()
    differs = nodes.same_everywhere("the draft vocabulary (vocab.safetensors)", digest, layout)
    if differs:
        raise UsageError(f"{differs}: give every node the same --vocab")


# ---------------------------------------------------------------- each node on its own part


class NodeRows(Dataset[dict[str, Any]]):
    """A split whose rows are spread over the nodes, seen from one node. Indices offsets[n] .. offsets[n] +
    blocks[n] are node n's; this node reads only its own. Each node's block is its rows, then copies of them with
    `loss_mask` all False (they train and count nothing) up to the steps every node takes: every rank runs the
    same number of batches, as the collectives of each step need."""

    def __init__(self, rows: Dataset[dict[str, Any]], layout: nodes.NodeLayout, lengths: Sequence[int], batch: int,
                 stats: dict[str, float], filler: dict[str, Any] | None = None) -> None:
        self.rows, self.layout, self.batch, self.stats = rows, layout, batch, stats
        self.lengths = list(lengths)
        self.filler = filler  # a row to mask where this node holds none of the split
        local = [len(ranks) for ranks in layout.node_ranks]
        self.steps = max(math.ceil(n / (w * batch)) for n, w in zip(self.lengths, local))
        self.blocks = [self.steps * w * batch for w in local]
        self.offsets = [sum(self.blocks[:n]) for n in range(layout.nodes)]

    def __len__(self) -> int:
        return sum(self.blocks)

    def __getitem__(self, index: int) -> dict[str, Any]:
        node = self.layout.node
        i = index - self.offsets[node]
        if not 0 <= i < self.blocks[node]:
            raise IndexError(f"row {index} is another node's part (this is node {node}): read NodeRows through "
                             "NodeSampler")
        own = self.lengths[node]
        if i < own:
            return self.rows[i]
        row = self.rows[i % own] if own else self.filler
        assert row is not None  # spread_over_nodes gives a filler to a node without rows
        return {**row, "loss_mask": torch.zeros_like(row["loss_mask"])}

    def sampler(self, shuffle: bool, seed: int) -> NodeSampler:
        return NodeSampler(self, shuffle, seed)


class NodeSampler(Sampler[int]):
    """The order accelerate deals out: it hands batch k to rank k % world_size, so the global order lists, step
    by step and rank by rank, `batch` rows of that rank's node (a permutation of each node's block per epoch, or
    its order). Every rank computes the same order; each reads only its own batches."""

    def __init__(self, rows: NodeRows, shuffle: bool, seed: int) -> None:
        self.rows, self.shuffle, self.seed, self.epoch = rows, shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[int]:
        rows, layout = self.rows, self.rows.layout
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        orders = [(torch.randperm(block, generator=g) if self.shuffle else torch.arange(block)).tolist()
                  for block in rows.blocks]
        node_of = {r: (n, j) for n, ranks in enumerate(layout.node_ranks) for j, r in enumerate(ranks)}
        b = rows.batch
        for step in range(rows.steps):
            for rank in range(layout.world_size):
                node, j = node_of[rank]
                start = (step * len(layout.node_ranks[node]) + j) * b
                for k in range(b):
                    yield rows.offsets[node] + orders[node][start + k]


def spread_over_nodes(train: PackedDataset | NodeRows, evals: PackedDataset | NodeRows, layout: nodes.NodeLayout,
                      args: Eagle3TrainingArguments) -> tuple[NodeRows, NodeRows]:
    """The training and validation splits of every node's part, each node reading its own: the rows per node are
    gathered so that every rank steps through the same number of batches. The stats are summed over the nodes
    (what the run trained on)."""
    assert not isinstance(train, NodeRows) and not isinstance(evals, NodeRows), "spread once"
    if args.train_sampling_strategy != "random" or args.auto_find_batch_size:
        raise UsageError("--per-node-features orders each node's rows itself: drop --train_sampling_strategy "
                         f"{args.train_sampling_strategy} / --auto_find_batch_size")
    config = args.accelerator_config
    if getattr(config, "split_batches", False) or getattr(config, "dispatch_batches", None):
        raise UsageError("--per-node-features: each rank reads its own node's batches; accelerator_config "
                         "split_batches / dispatch_batches would hand out rank 0's")
    views = nodes.all_gather((layout.node, len(train), len(evals), dict(train.stats), dict(evals.stats)))
    first = {node: view for node, *view in reversed(views)}  # one view per node (its ranks read the same part)
    train_lengths = [first[n][0] for n in range(layout.nodes)]
    if min(train_lengths) == 0:
        empty = train_lengths.index(0)
        raise UsageError(f"--per-node-features: node {empty} (host {layout.hosts[empty]}) has no training rows in "
                         "its part")

    def summed(k: int) -> dict[str, float]:
        keys = first[0][k].keys()
        total = {key: sum(first[n][k][key] for n in range(layout.nodes)) for key in keys if key != "fill"}
        tokens, rows, width = total.get("tokens", 0), total.get("rows", 0), train.max_seq_len
        total["fill"] = round(tokens / (rows * width), 4) if rows and width else 0.0
        total["nodes"] = layout.nodes
        return total

    filler = None if len(evals) else train[0]
    return (NodeRows(train, layout, train_lengths, args.per_device_train_batch_size, summed(2)),
            NodeRows(evals, layout, [first[n][1] for n in range(layout.nodes)], args.per_device_eval_batch_size,
                     summed(3), filler))
