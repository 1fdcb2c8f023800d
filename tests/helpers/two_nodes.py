"""Two "nodes" on one machine: a command launched twice over loopback (static rendezvous on 127.0.0.1, gloo), one
process per node, each node given its own arguments (its own local directories): what the two-node tests share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "accelerate_configs/multinode_ddp_template.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(launcher: str, per_node: list[list[str]], timeout: float = 300) -> list[tuple[int, str]]:
    """Launch node ranks 0 and 1 at once, one process each; (exit status, output) per node. `launcher`: "torchrun"
    (`-m eagle3_hf.cli ...`) or "accelerate" (examples/train.py under the multi-node DDP template, as written)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")

    def command(node: int) -> list[str]:
        if launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                    "-m", "eagle3_hf.cli", *per_node[node]]
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(TEMPLATE),
                "--num_processes", "2", "--machine_rank", str(node), "--main_process_ip", "127.0.0.1",
                "--main_process_port", str(port), "--mixed_precision", "no", str(ROOT / "examples/train.py"),
                *per_node[node]]

    procs = [subprocess.Popen(command(node), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=ROOT) for node in (0, 1)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, log) for p, log in zip(procs, logs)]


def error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("error:")]
