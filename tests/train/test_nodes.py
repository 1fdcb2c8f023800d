"""The pieces of a multi-node run that one process can check: nodes told apart, node parts that make (or do not
make) one dataset, a node part refused when read alone, and each node's rows dealt out by accelerate to that node's
ranks only, every rank through the same number of batches. tests/train/test_two_nodes.py runs them over two
launched "nodes"."""

from __future__ import annotations

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

from eagle3_hf import nodes
from eagle3_hf.errors import UsageError
from eagle3_hf.features.store import PartialFeaturesError, load_manifest, merge_manifests
from eagle3_hf.train.nodes import NodeRows, parts_problem


def layout(node_ranks: tuple[tuple[int, ...], ...], rank: int) -> nodes.NodeLayout:
    views = [(r, f"group{n}", f"host{n}", f"t{r}") for n, ranks in enumerate(node_ranks) for r in ranks]
    return nodes.layout_from(views, rank)


def test_nodes_are_told_apart_by_group_rank_and_numbered_by_lowest_rank():
    views = [(2, "group1", "b", "x2"), (0, "group0", "a", "x0"), (3, "group1", "b", "x3"), (1, "group0", "a", "x1")]
    got = nodes.layout_from(views, 3)
    assert got.node_ranks == ((0, 1), (2, 3)) and got.hosts == ("a", "b")
    assert (got.node, got.local_rank, got.nodes, got.world_size, got.token) == (1, 1, 2, 4, "x0")  # rank 0's token
    assert nodes.launch_nodes({"WORLD_SIZE": "16", "GROUP_WORLD_SIZE": "2"}) == 2
    assert nodes.launch_nodes({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert nodes.launch_nodes({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}) == 1
    assert nodes.launch_nodes({"WORLD_SIZE": "1"}) == 1
    assert nodes.launch_nodes({"WORLD_SIZE": "4"}) is None  # a launcher that says neither: gather host names


def part(node: int, nodes_: int = 2, total: int = 10, digest: str = "d") -> dict:
    return {"node": node, "nodes": nodes_, "host": f"host{node}", "dataset_samples": total,
            "dataset_ids_sha256": digest}


def test_node_parts_must_make_one_dataset_once():
    two = layout(((0,), (1,)), 0)
    assert parts_problem([(0, part(0), 6), (1, part(1), 4)], two) is None
    assert "rank 1 on host host1 reads no node part" in parts_problem([(0, part(0), 6), (1, None, 10)], two)
    assert "parts [0, 0]" in parts_problem([(0, part(0), 6), (1, part(0), 4)], two)
    assert "different prepared datasets" in parts_problem([(0, part(0), 6), (1, part(1, digest="e"), 4)], two)
    three = [(0, part(0, 3), 6), (1, part(1, 3), 4)]
    assert "host0 holds part 0 of 3 nodes; this run has 2" in parts_problem(three, two)
    assert "hold 9 samples, the dataset has 10" in parts_problem([(0, part(0), 6), (1, part(1), 3)], two)


def test_same_everywhere_names_the_rank_that_differs(monkeypatch):
    two = layout(((0, 1), (2,)), 0)
    monkeypatch.setattr(nodes, "all_gather", lambda value: ["a" * 64, "a" * 64, None])
    line = nodes.same_everywhere("--features F", "a" * 64, two)
    assert line == ("--features F differs between nodes: rank 0 on host host0 reads sha256 aaaaaaaaaaaa, rank 2 on "
                    "host host1 reads nothing")
    monkeypatch.setattr(nodes, "all_gather", lambda value: ["a", "a", "a"])
    assert nodes.same_everywhere("--features F", "a", two) is None
    assert nodes.not_shared("--output-dir", "/o", two, 1, "fix it") == (
        "--output-dir /o is not shared between nodes (rank 0 on host host0 sees 1/2 nodes' markers): fix it")


def test_a_node_part_read_alone_is_refused_in_one_line(synthetic, tmp_path):
    import shutil

    features = tmp_path / "features"
    shutil.copytree(synthetic["features"], features)
    merge_manifests(features, node_part=part(1, total=96))
    with pytest.raises(PartialFeaturesError, match=r"node 1's part of an extraction over 2 nodes \(48 of 96 samples\)"
                       r": train on all 2 nodes with --per-node-features"):
        load_manifest(features)
    assert load_manifest(features, node_part=True)["node_part"]["node"] == 1


def dealt(rows: NodeRows, world: int, epoch: int = 0, shuffle: bool = True) -> list[list[int]]:
    """The indices accelerate hands each rank (BatchSamplerShard, as Trainer.get_train_dataloader prepares it)."""
    out = []
    for rank in range(world):
        sampler = rows.sampler(shuffle, seed=7)
        sampler.set_epoch(epoch)
        shard = BatchSamplerShard(BatchSampler(sampler, rows.batch, drop_last=False), num_processes=world,
                                  process_index=rank, even_batches=True)
        out.append([i for batch in shard for i in batch])
    return out


class Rows(torch.utils.data.Dataset):
    def __init__(self, node: int, n: int):
        self.node, self.n = node, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"row": (self.node, i), "loss_mask": torch.ones(3, dtype=torch.bool)}


@pytest.mark.parametrize("node_ranks,lengths,batch", [(((0, 1), (2, 3)), [11, 7], 2),
                                                      (((0, 1, 2), (3,)), [13, 2], 1),
                                                      (((0,), (1,)), [5, 0], 2)])
def test_each_node_reads_every_row_of_its_own_part_once_per_epoch(node_ranks, lengths, batch):
    world = sum(len(r) for r in node_ranks)
    per_node = [NodeRows(Rows(n, lengths[n]), layout(node_ranks, node_ranks[n][0]), lengths, batch, {},
                         filler=Rows(0, 1)[0]) for n in range(len(node_ranks))]
    got = dealt(per_node[0], world)
    assert got == dealt(per_node[1], world)  # every rank computes the same order
    assert len({len(indices) for indices in got}) == 1  # every rank runs the same number of batches
    for n, ranks in enumerate(node_ranks):
        rows = per_node[n]
        read = [rows[i] for r in ranks for i in got[r]]  # raises IndexError for another node's row
        real = [row["row"] for row in read if row["loss_mask"].any()]
        assert sorted(real) == [(n, i) for i in range(lengths[n])]  # each of its rows once
        assert len(read) - len(real) == rows.blocks[n] - lengths[n]  # the rest: masked copies, counting nothing
    other = per_node[0].offsets[1]
    with pytest.raises(IndexError, match="another node's part"):
        per_node[0][other]
    assert dealt(per_node[0], world, epoch=1) != got or max(lengths) <= 1  # a new order per epoch
    assert dealt(per_node[0], world, shuffle=False) == dealt(per_node[0], world, shuffle=False)


def test_training_check_refuses_a_shared_output_with_save_on_each_node(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from eagle3_hf.train import nodes as train_nodes
    from eagle3_hf.train.arguments import DataArguments

    two = layout(((0,), (1,)), 0)
    monkeypatch.setattr(nodes, "multi_node", lambda: True)
    monkeypatch.setattr(nodes, "gather_layout", lambda: two)
    monkeypatch.setattr(nodes, "check_shared", lambda path, layout: [2, 2])  # both nodes see both markers
    args = SimpleNamespace(output_dir=str(tmp_path), world_size=2, save_on_each_node=True, deepspeed=None)
    with pytest.raises(UsageError, match="--save_on_each_node with --output-dir .* shared by all 2 nodes"):
        train_nodes.check_training_nodes(DataArguments(features="hf"), args)
    monkeypatch.setattr(nodes, "check_shared", lambda path, layout: [1, 1])
    args.save_on_each_node, args.deepspeed = True, "ds_configs/zero3.json"
    with pytest.raises(UsageError, match="DeepSpeed partitions its checkpoints"):
        train_nodes.check_training_nodes(DataArguments(features="hf"), args)
