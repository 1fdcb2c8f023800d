"""The /dev/shm a node's data loaders need, printed by `plan` and checked by `train` before the first step.

Where batches go through shared memory: with `dataloader_num_workers` W > 0 each batch is built in a worker
process, in shared memory from the start (`PackedCollator` allocates its tensors there, features/packing.py), and
reaches the training process as a file in /dev/shm. torch's DataLoader keeps `prefetch_factor` P batches in
flight per worker, so W x P batches of a rank live there at once, plus the one the training process holds while
its slot refills. The Trainer's evaluation loader has the same workers; when it runs inside an epoch
(`eval_strategy: steps`) the training loader's batches stay in flight beside its own. Pinned memory
(`dataloader_pin_memory`) is page-locked host memory, not /dev/shm. A container's /dev/shm is 64 MB unless it
is started with `--ipc=host` or `--shm-size`; a worker that runs out dies with "Bus error", at step 0 or at the
first evaluation.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHM = "/dev/shm"
INDEX_BYTES = 4 * 8 + 1  # input_ids, verifier_greedy, position_ids, document_ids (int64), loss_mask (bool)
TORCH_PREFETCH = 2  # torch's DataLoader default prefetch_factor
HF_EVAL_BATCH = 8  # TrainingArguments' default per_device_eval_batch_size
CHECK_CHOICES = ("refuse", "warn", "off")


def batch_feature_bytes(dtype: str) -> int:
    """Bytes of one hidden-state element in a batch: bf16/fp16 stay as stored, fp8 is decoded to float32
    (PackedCollator)."""
    name = str(dtype).lower()
    if name in ("bf16", "bfloat16", "fp16", "float16"):
        return 2
    if name in ("fp8", "float8_e4m3fn", "fp32", "float32"):
        return 4
    raise ValueError(f"unknown feature dtype {dtype!r}")


def row_bytes(max_seq_len: int, target_hidden: int, dtype: str = "bf16") -> int:
    """One packed row of a batch: [L, 3H] aux + [L, H] last hidden state + the per-token ids and mask."""
    return max_seq_len * (4 * target_hidden * batch_feature_bytes(dtype) + INDEX_BYTES)


@dataclass(frozen=True)
class ShmNeed:
    """Peak /dev/shm of one node's data loaders: every rank's rows in flight x bytes per row (`rows_per_rank`)."""

    ranks: int  # training processes on the node
    workers: int  # dataloader_num_workers per rank
    prefetch: int  # dataloader_prefetch_factor
    train_rows: int  # rows per training batch
    eval_rows: int  # rows per evaluation batch (0: no evaluation)
    eval_within_epoch: bool  # evaluation runs while the training loader's batches are in flight
    row_bytes: int

    @property
    def rows_per_rank(self) -> int:
        """The workers' prefetch slots of the loader being read, plus the batch the training process holds while
        its slot refills (measured: bench/shm_loader.py), plus, inside an epoch, the training loader's slots."""
        if not self.workers:
            return 0
        slots = self.workers * self.prefetch
        if self.eval_within_epoch and self.eval_rows:
            return slots * self.train_rows + (slots + 1) * self.eval_rows
        return (slots + 1) * max(self.train_rows, self.eval_rows)

    @property
    def bytes(self) -> int:
        return self.ranks * self.rows_per_rank * self.row_bytes

    def formula(self) -> str:
        slots = self.workers * self.prefetch
        if self.eval_within_epoch and self.eval_rows:
            rows = (f"{slots * self.train_rows} training + {(slots + 1) * self.eval_rows} evaluation rows in flight "
                    f"inside an epoch")
        else:
            rows = f"{self.rows_per_rank} rows in flight"
        return (f"{self.ranks} rank(s) x {rows} x {self.row_bytes / 1e6:,.1f} MB; {self.workers} worker(s) x "
                f"prefetch {self.prefetch}, + 1 batch in hand")


def shm_need(*, ranks: int, workers: int, prefetch: int | None, train_rows: int, eval_rows: int,
             eval_within_epoch: bool, max_seq_len: int, target_hidden: int, dtype: str = "bf16") -> ShmNeed:
    """The peak, from the run's settings (module docstring). No workers: batches are built in the training
    process and nothing goes through /dev/shm."""
    return ShmNeed(ranks=max(1, ranks), workers=max(0, workers), prefetch=prefetch or TORCH_PREFETCH,
                   train_rows=train_rows, eval_rows=eval_rows, eval_within_epoch=eval_within_epoch,
                   row_bytes=row_bytes(max_seq_len, target_hidden, dtype))


def need_from_settings(settings: dict[str, Any], ranks: int, target_hidden: int, dtype: str = "bf16") -> ShmNeed:
    """The peak for a recipe's (or parsed arguments') keys: dataloader_num_workers, dataloader_prefetch_factor,
    per_device_train/eval_batch_size, eval_strategy, max_seq_len. Missing keys take the training script's GPU
    defaults (train/arguments.py loader_defaults: 4 workers on a node with 4 cores per rank, prefetch 4)."""
    eval_strategy = str(getattr(settings.get("eval_strategy"), "value", settings.get("eval_strategy", "epoch")))
    return shm_need(ranks=ranks, workers=int(settings.get("dataloader_num_workers", 4)),
                    prefetch=settings.get("dataloader_prefetch_factor", 4),
                    train_rows=int(settings.get("per_device_train_batch_size", 1)),
                    eval_rows=int(settings.get("per_device_eval_batch_size", HF_EVAL_BATCH))
                    if eval_strategy != "no" else 0,
                    eval_within_epoch=eval_strategy == "steps", max_seq_len=int(settings.get("max_seq_len", 2048)),
                    target_hidden=target_hidden, dtype=dtype)


def feature_dtype(features: str | None) -> str:
    """The stored dtype of a feature directory (its manifest's header), bf16 where none is written yet."""
    path = Path(features or "") / "manifest.json"
    if features and path.is_file():
        with open(path, encoding="utf-8") as f:
            return str(json.load(f).get("dtype") or "bf16")
    return "bf16"


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.0f} MiB"


def shm_problem(need: ShmNeed, path: str = SHM) -> str | None:
    """One line saying what to do when `path` has less free space than `need`, else None (also when there is no
    such filesystem to measure)."""
    if not need.bytes:
        return None
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    if free >= need.bytes:
        return None
    return (f"{path} has {gib(free)} free but the data loaders need {gib(need.bytes)} on this node "
            f"({need.formula()}): start the container with `docker run --ipc=host` (or `--shm-size "
            f"{max(1, -(-need.bytes * 5 // 4 // 2**30))}g`), or lower --dataloader-num-workers, "
            f"--dataloader-prefetch-factor or --per-device-eval-batch-size")


def shm_plan(recipe: dict[str, Any], ranks_per_node: int, target_hidden: int) -> ShmNeed:
    """`plan`'s /dev/shm need for a recipe, with the stored dtype of its features."""
    return need_from_settings(recipe, ranks_per_node, target_hidden, feature_dtype(recipe.get("features")))


def shm_plan_line(need: ShmNeed) -> str:
    """`plan`'s line for `shm_plan`'s need."""
    if not need.bytes:
        return "  /dev/shm    none (no data-loader workers: batches are built in the training processes)"
    return (f"  /dev/shm    {gib(need.bytes)} per node ({need.formula()}); a container needs `--ipc=host` "
            f"or `--shm-size`")


def loader_workers(features: str | None, requested: int, cuda: bool) -> int:
    """The data-loader workers `train` runs with for `--features` (scripts/train.py): the verifier in the training
    process (`hf`) takes none; a server (ours or SGLang) on a GPU none (its head runs in the main process), else
    `requested` or training_data.DEFAULT_WORKERS."""
    from ..features.table import FeatureSpec
    from .training_data import DEFAULT_WORKERS

    spec = FeatureSpec.parse(features) if features else None
    if spec is None or not spec.online:
        return requested
    if spec.remote and not cuda:
        return requested or DEFAULT_WORKERS
    return 0


def check_at_start(args: Any, features: str | None, max_seq_len: int, target_hidden: int, ranks: int,
                   cuda: bool) -> ShmNeed:
    """`train`'s check, before any shard is read: the node's /dev/shm against `shm_need` for the parsed
    TrainingArguments `args` (their `shm_check`: refuse with a UsageError, warn on stderr, or off)."""
    import sys

    from ..errors import UsageError

    workers = loader_workers(features, int(args.dataloader_num_workers or 0), cuda)
    settings = {"dataloader_num_workers": workers, "dataloader_prefetch_factor": args.dataloader_prefetch_factor,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "per_device_eval_batch_size": args.per_device_eval_batch_size,
                "eval_strategy": args.eval_strategy, "max_seq_len": max_seq_len}
    need = need_from_settings(settings, ranks, target_hidden, feature_dtype(features))
    problem = None if args.shm_check == "off" else shm_problem(need)
    if problem and args.shm_check == "refuse":
        raise UsageError(f"{problem} (--shm-check warn starts anyway)")
    if problem:
        print(f"WARNING: {problem}", file=sys.stderr)
    return need
