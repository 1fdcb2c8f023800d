"""The plan's disk: what the training run reads from the feature disk and whether those reads or the GPUs bound it,
and what the extraction writes.

Training reads every training token's features once per epoch and the validation split at every evaluation (the
recipe's `eval_strategy`, plus the final one the training script runs). Each node reads its share: the ranks of a
node take 1 / nodes of every epoch's rows, from a shared directory or its own part (`--per-node-features`), so
per node that is the run's bytes over the nodes, at `--disk-gbps`, the rate one node's feature disk sustains (on a
shared filesystem: its total over the nodes). The run takes the longer of its compute and its reads. Reads are
counted from the disk every epoch: a node whose page cache holds its share of the features reads the later epochs
from memory, and then the bound is lower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .plan_inputs import Launch


def stored_dtype(name: str | None) -> str:
    """bf16 / fp8 / fp32, as `feature_bytes_per_token` takes it, from a manifest's dtype name."""
    text = str(name or "bf16").lower()
    if "8" in text:
        return "fp8"
    return "fp32" if text in ("fp32", "float32") else "bf16"


def evaluations(recipe: dict[str, Any], train_tokens: float, launch: Launch, epochs: float) -> int:
    """Evaluations a run makes: every `eval_steps` optimizer steps (a float < 1: a fraction of them), every epoch,
    or none, plus the training script's final one; optimizer steps from packed rows of `max_seq_len` tokens."""
    if float(recipe.get("validation_fraction", 0.0)) <= 0:
        return 0
    strategy = str(recipe.get("eval_strategy", "epoch"))
    rows = math.ceil(train_tokens / int(recipe.get("max_seq_len", 2048)))
    per_step = (int(recipe.get("per_device_train_batch_size", 1)) * max(1, launch.num_processes)
                * int(recipe.get("gradient_accumulation_steps", 1)))
    steps = math.ceil(math.ceil(rows / per_step) * epochs)
    if strategy == "steps":
        every = float(recipe.get("eval_steps") or recipe.get("logging_steps") or 500)
        every = every * steps if every < 1 else every
        return int(steps // max(1.0, every)) + 1
    return (math.ceil(epochs) if strategy == "epoch" else 0) + 1


@dataclass(frozen=True)
class TrainingReads:
    """What each node reads over the run, how long its disk takes, and what bounds the run (`training_reads`)."""

    read_bytes_per_node: float
    evaluations: int
    read_hours: float
    compute_hours: float
    run_hours: float
    bound: str  # "disk" or "compute"
    disk_gbps: float
    nodes: int

    def lines(self, epochs: float) -> list[str]:
        """The plan's disk and run lines."""
        evals = f" + {self.evaluations} evaluation(s)" if self.evaluations else ""
        nodes = f" (1/{self.nodes} of the run's)" if self.nodes > 1 else ""
        return [f"  disk        {epochs:g} epochs{evals} read {self.read_bytes_per_node / 1e9:,.0f} GB per node"
                f"{nodes}: {self.read_hours:.2f} h at {self.disk_gbps:g} GB/s (--disk-gbps)",
                f"  run         {self.run_hours:.2f} h (bound: {self.bound}; compute {self.compute_hours:.2f} h, disk "
                f"{self.read_hours:.2f} h)"]


def training_reads(recipe: dict[str, Any], launch: Launch, dataset_tokens: float, bytes_per_token: int,
                   epochs: float, disk_gbps: float, compute_hours: float) -> TrainingReads:
    """Bytes each node reads over the run, how long its disk takes for them, and what bounds the run."""
    validation = float(recipe.get("validation_fraction", 0.0))
    train_tokens, val_tokens = dataset_tokens * (1 - validation), dataset_tokens * validation
    evals = evaluations(recipe, train_tokens, launch, epochs)
    total = (epochs * train_tokens + evals * val_tokens) * bytes_per_token
    nodes = max(1, launch.num_machines)
    read_hours = total / nodes / (disk_gbps * 1e9) / 3600
    return TrainingReads(read_bytes_per_node=total / nodes, evaluations=evals, read_hours=read_hours,
                         compute_hours=compute_hours, run_hours=max(compute_hours, read_hours),
                         bound="disk" if read_hours > compute_hours else "compute", disk_gbps=disk_gbps, nodes=nodes)


@dataclass(frozen=True)
class ExtractionBudget:
    """The extraction's prefill rate against the disks that take its features (`extraction_budget`)."""

    tokens_per_s: float
    tokens_per_s_from: str
    write_gbps: float  # per node
    disk_gbps: float
    nodes: int
    bound: str  # "disk" or "verifier"
    hours: float
    bytes: float

    def lines(self) -> list[str]:
        """The extraction's time and disk budget, printed beside the training's."""
        per_node = " per node" if self.nodes > 1 else ""
        return [f"  extract at  {self.tokens_per_s:,.0f} tokens/s ({self.tokens_per_s_from})",
                f"              writes {self.write_gbps:.2f} GB/s{per_node} of bf16 features: {self.bytes / 1e9:,.0f} "
                f"GB in {self.hours:.2f} h ({self.bound}-bound; disk {self.disk_gbps:g} GB/s{per_node})"]


def extraction_budget(dataset_tokens: float, tokens_per_s: float, tokens_per_s_from: str, bytes_per_token: int,
                      disk_gbps: float, nodes: int) -> ExtractionBudget:
    """The extraction's budget: prefill tokens/s (all its GPUs) against what the nodes' disks take (each node
    writes its share)."""
    disk_tps = disk_gbps * 1e9 / bytes_per_token * max(1, nodes)
    return ExtractionBudget(tokens_per_s=tokens_per_s, tokens_per_s_from=tokens_per_s_from,
                            write_gbps=tokens_per_s * bytes_per_token / 1e9 / max(1, nodes), disk_gbps=disk_gbps,
                            nodes=max(1, nodes), bound="disk" if disk_tps < tokens_per_s else "verifier",
                            hours=dataset_tokens / min(tokens_per_s, disk_tps) / 3600,
                            bytes=bytes_per_token * dataset_tokens)
