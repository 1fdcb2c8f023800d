"""/dev/shm held by the Trainer's data loaders, measured, beside what eagle3_hf/train/shm.py says they need.

The real `PackedCollator` builds packed rows of synthetic bf16 features in DataLoader workers (as `train` does on a
GPU: persistent workers, `prefetch_factor`), while the main process takes one batch at a time slowly enough that
every worker's queue fills. /dev/shm's used bytes are sampled after every batch; the peak above the start is
compared with `shm_need` (no pinned memory on the CPU: with `dataloader_pin_memory` on a GPU the batch in hand
is a pinned copy, so the need is an upper bound there). Two settings: the training loader alone, and evaluation
inside an epoch (an evaluation loader of `--eval-rows` rows per batch iterated to its end while the training
loader's batches are in flight). Other processes may write /dev/shm meanwhile: each setting runs `--repeats`
times and the smallest peak is kept.

    python -m bench.shm_loader [--workers 2] [--prefetch 2] [--hidden 576] [--max-seq-len 2048] [--eval-rows 4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time

import torch
from torch.utils.data import DataLoader, Dataset

from eagle3_hf.features.packing import PackedCollator
from eagle3_hf.train.shm import SHM, shm_need


class Rows(Dataset):
    """Packed rows of one document each, `max_seq_len` tokens of bf16 features (what a shard row holds)."""

    def __init__(self, n: int, max_seq_len: int, hidden: int) -> None:
        self.n, self.length, self.hidden = n, max_seq_len, hidden

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        L, H = self.length, self.hidden
        return {"input_ids": torch.full((L,), i), "verifier_greedy": torch.zeros(L, dtype=torch.long),
                "loss_mask": torch.ones(L, dtype=torch.bool), "position_ids": torch.arange(L),
                "document_ids": torch.zeros(L, dtype=torch.long), "max_seq_len": L,
                "aux_hidden_states": torch.ones(L, 3 * H, dtype=torch.bfloat16),
                "last_hidden_state": torch.ones(L, H, dtype=torch.bfloat16)}


def used() -> int:
    return shutil.disk_usage(SHM).used


def loader(rows: int, batch: int, args: argparse.Namespace) -> DataLoader:
    return DataLoader(Rows(rows, args.max_seq_len, args.hidden), batch_size=batch, num_workers=args.workers,
                      prefetch_factor=args.prefetch, persistent_workers=True,
                      collate_fn=PackedCollator(max_seq_len=args.max_seq_len))


def peak(args: argparse.Namespace, with_eval: bool) -> int:
    """Bytes of /dev/shm above the start, at most, while the loaders run."""
    train = loader(4 * args.workers * args.prefetch, 1, args)
    evals = loader(2 * args.workers * args.prefetch * args.eval_rows, args.eval_rows, args) if with_eval else None
    start, top = used(), 0
    it = iter(train)
    for step in range(2 * args.workers * args.prefetch):
        batch = next(it)
        time.sleep(args.consume_s)  # a training step: the workers fill their prefetch slots meanwhile
        top = max(top, used() - start)
        del batch
        if evals is not None and step == args.workers * args.prefetch:  # evaluation inside the epoch
            for eval_batch in evals:
                time.sleep(args.consume_s)
                top = max(top, used() - start)
                del eval_batch
    del it, train, evals
    return top


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--eval-rows", type=int, default=4)
    parser.add_argument("--consume-s", type=float, default=0.3, help="seconds the main process holds each batch")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = {"workers": args.workers, "prefetch": args.prefetch, "hidden": args.hidden, "max_seq_len": args.max_seq_len,
           "eval_rows": args.eval_rows}
    for name, with_eval in (("train_only", False), ("eval_within_epoch", True)):
        need = shm_need(ranks=1, workers=args.workers, prefetch=args.prefetch, train_rows=1,
                        eval_rows=args.eval_rows if with_eval else 0, eval_within_epoch=with_eval,
                        max_seq_len=args.max_seq_len, target_hidden=args.hidden)
        measured = min(peak(args, with_eval) for _ in range(args.repeats))
        out[name] = {"measured_peak_mb": round(measured / 1e6, 1), "estimate_mb": round(need.bytes / 1e6, 1),
                     "measured_over_estimate": round(measured / need.bytes, 3)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
