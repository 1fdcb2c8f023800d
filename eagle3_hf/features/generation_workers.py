"""The processes of `regenerate --features-out --num-workers N` (the transformers route): one rank's loop
(`work`: batches from a queue, answers made durable in OUTPUT.rNNN.pending before their shard can be journaled,
samples written through write.FeatureSink), the N-1 spawned ones (`spawned_worker`, `start_workers`, `drain`),
and on resume the move of answers whose shard is journaled from the pending files to OUTPUT (`settle_answers`).
Kept apart from the command (transformers_generation.py) so that the crash-safety rules read in one place.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from ..data.regenerate import completed_ids
from ..data.regenerate_backends import TransformersBackend
from ..errors import UsageError
from .generated_samples import Template, run_batch
from .interface import PreparedSample, SampleFeatures
from .records import FeatureHeader
from .store import merge_manifests
from .write import FeatureSink, StoreOptions

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue


class WorkerJob(TypedDict):
    """What every worker process writes with (sent to the spawned ones)."""

    aux: list[int]
    header: FeatureHeader
    features_out: str
    output: str
    store: StoreOptions
    max_turns: int | None
    max_seq_len: int | None


class WorkerReport(TypedDict, total=False):
    """A worker's message to the driver: a batch done, the worker's error, or its end."""

    rank: int
    conversations: int
    samples: int
    tokens: int
    skipped: dict[str, int]
    generated: int
    error: str
    finished: bool


# ---------------------------------------------------------------- one rank

def pending_path(output: Path, rank: int) -> Path:
    """Where rank `rank` keeps its answers until their shard is journaled."""
    return output.with_name(f"{output.name}.r{rank:03d}.pending")


def work(rank: int, backend: TransformersBackend, job: WorkerJob, next_batch: Callable[[], list[dict[str, Any]] | None],
          report: Callable[[WorkerReport], None], sink: FeatureSink | None = None) -> None:
    """Process batches until next_batch() returns None; report(dict) after each. Writes through `sink` (the
    driver's, rank 0) or a sink of its own rank (a spawned worker); closes it at the end."""
    gen = backend.generator(job["aux"])
    template = Template(backend.tokenizer, backend.chat_template_kwargs)
    sink = sink or FeatureSink(job["features_out"], job["header"], store=job["store"], rank=rank)
    pending = open(pending_path(Path(job["output"]), rank), "ab")
    try:
        while (batch := next_batch()) is not None:
            done, generated = run_batch(batch, backend, gen, template, job["max_turns"], job["max_seq_len"])
            pending.write(b"".join((json.dumps(row, ensure_ascii=False) + "\n").encode() for row, _ in done))
            pending.flush()
            os.fsync(pending.fileno())  # answers are durable before their shard can be journaled
            samples = tokens = 0
            skipped: dict[str, int] = {}
            for row, sample in done:
                if isinstance(sample, str):
                    sink.skip(str(row["id"]), sample)
                    skipped[sample] = skipped.get(sample, 0) + 1
                elif sink.add(SampleFeatures(PreparedSample(str(row["id"]), sample["input_ids"], sample["loss_mask"]),
                                             sample["aux_hidden_states"], sample["last_hidden_state"],
                                             sample["verifier_greedy"])):
                    samples += 1
                    tokens += sample["input_ids"].numel()
                else:
                    skipped["nan_or_inf"] = skipped.get("nan_or_inf", 0) + 1
            report({"rank": rank, "conversations": len(done), "samples": samples, "tokens": tokens,
                    "skipped": skipped, "generated": generated})
    finally:
        sink.close()
        pending.close()


def die_with_parent() -> None:
    """Linux: a spawned worker is killed when its parent dies (no orphan keeps writing a rank's shards)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawned_worker(rank: int, spec: dict[str, Any], job: WorkerJob, tasks: Queue[list[dict[str, Any]] | None],
                    results: Queue[WorkerReport], threads: int) -> None:
    die_with_parent()
    torch.set_num_threads(threads)
    try:
        backend = TransformersBackend(**spec)

        def next_batch() -> list[dict[str, Any]] | None:
            return tasks.get()

        work(rank, backend, job, next_batch, results.put)
    except BaseException as e:  # reported to the parent, which fails the run
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise UsageError(1) from None
    results.put({"rank": rank, "finished": True})


def start_workers(backend: TransformersBackend, job: WorkerJob, batches: list[list[dict[str, Any]]], num_workers: int
                   ) -> tuple[list[BaseProcess], Queue[list[dict[str, Any]] | None], Queue[WorkerReport]]:
    """Spawn ranks 1..num_workers-1 on one queue of `batches` (an end marker per process, this one's included)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for b in batches:
        tasks.put(b)
    for _ in range(num_workers):
        tasks.put(None)  # one end marker per process, this one included
    threads = torch.get_num_threads()
    procs: list[BaseProcess] = [
        ctx.Process(target=spawned_worker, args=(r, backend.spec, job, tasks, results, threads), daemon=True)
        for r in range(1, num_workers)]
    for p in procs:
        p.start()
    return procs, tasks, results


def drain(results: Queue[WorkerReport], procs: list[BaseProcess], tick: Callable[[WorkerReport], None],
           timeout: float | None = None) -> None:
    """Hand every report the workers sent to `tick`; with `timeout`, wait that long for the first."""
    while True:
        try:
            msg = results.get(timeout=timeout) if timeout else results.get_nowait()
        except queue.Empty:
            return
        tick(msg)
        timeout = None


# ---------------------------------------------------------------- resume bookkeeping

def journaled_ids(features_out: Path) -> set[str]:
    try:
        manifest = merge_manifests(features_out, write=False)
    except FileNotFoundError:
        return set()
    done = {s["id"] for s in manifest["samples"]}
    for ids in manifest.get("skipped_ids", {}).values():
        done.update(ids)
    return done


def settle_answers(output: Path, features_out: Path) -> set[str]:
    """Move answers whose shard is journaled from the pending files to OUTPUT; drop the rest (redone)."""
    done = journaled_ids(features_out)
    present = completed_ids(output)
    stray = present - done
    if stray:
        raise ValueError(f"{output}: {len(stray)} conversations (e.g. {sorted(stray)[0]!r}) have no features in "
                         f"{features_out}; use a new --output, or prepare + extract them")
    with open(output, "ab") as f:
        for path in sorted(output.parent.glob(f"{output.name}.r*.pending")):
            raw = path.read_bytes()
            for line in raw[: raw.rfind(b"\n") + 1].splitlines():
                row = json.loads(line)
                if str(row["id"]) in done and str(row["id"]) not in present:
                    f.write(line + b"\n")
                    present.add(str(row["id"]))
        f.flush()
        os.fsync(f.fileno())
    for path in output.parent.glob(f"{output.name}.r*.pending"):
        path.unlink()
    return done

