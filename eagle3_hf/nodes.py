"""Which ranks share a node, and whether a directory named on every node's command line is one directory.

Under a launch over several nodes (`torchrun --nnodes N`, `accelerate launch --num_machines N`) a path passed to
every node may be one directory on a shared filesystem or a different local directory on each node. What reads
what another node wrote needs the first: extraction's merge (rank 0 reads every rank's journal), training's
best-model reload and resume (every rank loads the checkpoint rank 0 saved). On local disks that surfaces hours
later: a merge that waits for journals it can never see, a best checkpoint missing on every node but the first.
`check_shared` finds out at launch instead: each node's first process writes a marker file into the directory
and, after a barrier, every rank counts the nodes' markers it can see. `same_everywhere` compares what each node
reads (a digest) for paths that are only read.

Nodes are told apart by torchrun's GROUP_RANK (the host name where a launcher sets none), numbered in the order
of their lowest global rank.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

MARKER_WAIT_S = 5.0  # a rank that misses a node's marker looks again this long (a network filesystem's caches)


@dataclass(frozen=True)
class NodeLayout:
    """This rank's place in a multi-node launch."""

    rank: int
    node: int  # this rank's node, 0 .. nodes - 1
    local_rank: int  # its position among its node's ranks
    node_ranks: tuple[tuple[int, ...], ...]  # the global ranks of each node, ascending
    hosts: tuple[str, ...]  # each node's host name
    token: str  # one id for this launch (rank 0's), naming its marker files

    @property
    def nodes(self) -> int:
        return len(self.node_ranks)

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.node_ranks)

    @property
    def host(self) -> str:
        return self.hosts[self.node]

    def where(self) -> str:
        return f"rank {self.rank} on host {self.host}"


def launch_nodes(env: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """Nodes of this launch from the launcher's environment (torchrun's GROUP_WORLD_SIZE, or WORLD_SIZE over
    LOCAL_WORLD_SIZE); None when the launcher says neither (then only gathering the host names can tell)."""
    if int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        return 1
    if env.get("GROUP_WORLD_SIZE"):
        return int(env["GROUP_WORLD_SIZE"])
    if env.get("LOCAL_WORLD_SIZE"):
        return max(1, int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"]))
    return None


def multi_node() -> bool:
    """Whether this process may be one of several nodes' (a launch of one node needs no check)."""
    nodes = launch_nodes()
    return nodes is None or nodes > 1


def node_key() -> str:
    return f"group{os.environ['GROUP_RANK']}" if os.environ.get("GROUP_RANK") else socket.gethostname()


def layout_from(views: list[tuple[int, str, str, str]], rank: int) -> NodeLayout:
    """The layout from every rank's (rank, node key, host name, token candidate): nodes numbered by lowest rank."""
    by_key: dict[str, list[tuple[int, str]]] = {}
    for r, key, host, _ in sorted(views):
        by_key.setdefault(key, []).append((r, host))
    groups = sorted(by_key.values(), key=lambda members: members[0][0])
    node_ranks = tuple(tuple(r for r, _ in members) for members in groups)
    node = next(n for n, ranks in enumerate(node_ranks) if rank in ranks)
    token = next(t for r, _, _, t in views if r == 0)
    return NodeLayout(rank, node, node_ranks[node].index(rank), node_ranks,
                      tuple(members[0][1] for members in groups), token)


class ProcessGroup:
    """The default process group for the launch checks: the one in place (the Trainer's), or a gloo group made
    from the launcher's environment for this check only and destroyed after it, so that a long extraction is
    under no collective's timeout."""

    def __init__(self, timeout_s: float = 1800.0) -> None:
        self.timeout_s, self.made = timeout_s, False

    def __enter__(self) -> ProcessGroup:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=self.timeout_s))
            self.made = True
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        if self.made and dist.is_initialized():
            dist.destroy_process_group()


def all_gather(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (the default process group)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def gather_layout() -> NodeLayout:
    """Every rank's node, gathered over the default process group."""
    import torch.distributed as dist

    rank = dist.get_rank()
    views = all_gather((rank, node_key(), socket.gethostname(), uuid.uuid4().hex[:12]))
    return layout_from(views, rank)


def marker_dir(path: str | Path, layout: NodeLayout) -> Path:
    return Path(path) / f".eagle3-nodes-{layout.token}"


def check_shared(path: str | Path, layout: NodeLayout, wait_s: float = MARKER_WAIT_S) -> list[int]:
    """How many nodes' markers each rank sees in `path` (created if missing): a list by rank, `layout.nodes` for
    every rank when the directory is shared. Every rank takes part; the markers are removed after."""
    marks = marker_dir(path, layout)
    mine = marks / f"node{layout.node}"
    if layout.local_rank == 0:
        marks.mkdir(parents=True, exist_ok=True)
        mine.write_text(layout.host, encoding="utf-8")
    barrier()  # every node's marker is written (and closed) before any rank looks
    deadline = time.monotonic() + wait_s
    while True:
        seen = sum((marks / f"node{n}").exists() for n in range(layout.nodes))
        if seen == layout.nodes or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    views = all_gather(seen)  # every rank has looked
    if layout.local_rank == 0:
        mine.unlink(missing_ok=True)
    barrier()
    if layout.local_rank == 0:
        try:
            marks.rmdir()
        except OSError:
            pass  # another node's first process removed it (shared), or it is gone already
    return views


def not_shared(what: str, path: str | Path, layout: NodeLayout, seen: int, remedy: str) -> str:
    """The one line for a directory some node cannot see."""
    return (f"{what} {path} is not shared between nodes ({layout.where()} sees {seen}/{layout.nodes} nodes' "
            f"markers): {remedy}")


def file_digest(path: str | Path) -> str | None:
    """sha256 of a small file (a manifest, a vocabulary), None when it is missing."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def same_everywhere(what: str, value: str | None, layout: NodeLayout) -> str | None:
    """None when every rank reads the same `value` (a digest); else the one line saying which rank differs from
    rank 0 (every rank gets the same answer)."""
    views = all_gather(value)
    if all(v == views[0] for v in views):
        return None
    other = next(r for r, v in enumerate(views) if v != views[0])
    host = layout.hosts[next(n for n, ranks in enumerate(layout.node_ranks) if other in ranks)]

    def show(v: str | None) -> str:
        return "nothing" if v is None else f"sha256 {v[:12]}"

    return (f"{what} differs between nodes: rank 0 on host {layout.hosts[0]} reads {show(views[0])}, rank {other} "
            f"on host {host} reads {show(views[other])}")


# ---------------------------------------------------------------- the writer's scope

_node_local: dict[str, NodeLayout] = {}


def remember_node_local(path: str | Path, layout: NodeLayout) -> None:
    """The launch check found `path` local to each node and the run asked to work per node: the writer that
    merges it (features/write.py) merges this node's part only."""
    _node_local[str(Path(path).resolve())] = layout


def node_local(path: str | Path) -> NodeLayout | None:
    return _node_local.get(str(Path(path).resolve()))
