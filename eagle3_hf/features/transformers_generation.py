"""`eagle3-hf regenerate --verifier V [--features-out DIR]`: the in-process route; with features, answers, features and
the prepared dataset in one pass.

`regenerate` -> `prepare` -> `extract` runs the verifier twice over every answer token. Here the generation's
own hidden states are written (FeatureGenerator, eagle3_hf/verifier/generation.py): the same shards, journals,
manifest, checksums and refusals as `extract` (through its one write loop, write.FeatureSink), the conversations
to --output as `regenerate` writes them, and with --prepared-out the dataset `prepare` would write (id,
input_ids, loss_mask + its meta), for `vocab`.

A sample is prompt + generated answer + the template's tail after an answer, in the GENERATED token ids:
decoding an answer and tokenizing it again can give other ids, and the features belong to these. Loss mask
by prepare's rule: earlier assistant turns (prepare's spans, mapped onto the prompt's tokens), the answer,
and the tail up to its trailing whitespace (ChatML: `<|im_end|>` yes, the newline after it no).
Multi-turn conversations are answered turn by turn; the sample comes from the last turn's pass, whose
prefill covers the whole history. Refused by id, counted in the manifest like extract's refusals:
`no_generated_turn`, `messages_after_last_turn` (a tool call kept verbatim after it: run prepare + extract
for those), `template_rewrites_history`, `boundary_inside_token` (a tokenizer without offsets,
data/token_boundaries.py), `no_loss_tokens` (after --max-seq-len), `nan_or_inf`.

Numerics: a KV-cached, left-padded batched pass instead of extract's one full forward per sample, so the
features differ from extract's by float rounding (tests/features/test_transformers_generation.py states the tolerance).

--num-workers N: N processes (this one and N-1 spawned), each a rank of the feature directory as under
`extract` with torchrun, taking length-sorted batches from one queue (a process slowed by a busy machine
takes fewer). Resume: a conversation is done once its sample or refusal is journaled. Each rank appends its
answers to OUTPUT.rNNN.pending (fsync'd) before their shard can be journaled, and they move to OUTPUT when
that shard is; a kill at any point loses and duplicates nothing.

This module is the route (its row in generators.py; the command is commands/regenerate.py) and its driver; a
batch of conversations becomes samples in generated_samples.py, and the processes and their crash-safe answers
live in generation_workers.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..data.regenerate import ConversationTurns, GenerationOptions, RegenerateJob, RegenerateOutputs, regenerate, report
from ..data.regenerate_backends import TransformersBackend
from ..verifier.family import check_aux_indices, default_aux_indices
from .generated_samples import Template
from .generation_workers import WorkerJob, WorkerReport, drain, settle_answers, start_workers, work
from .interface import VerifierIdentity
from .prepared_from_shards import write_prepared
from .records import canonical_dtype, make_header
from .write import ExtractionSummary, FeatureSink, StoreOptions

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess


def regenerate_with_features(conversations: list[dict[str, Any]], outputs: RegenerateOutputs,
                             backend: TransformersBackend, *, generation: GenerationOptions | None = None,
                             num_workers: int = 1, batch_size: int = 16, dtype: str = "bfloat16",
                             aux_indices: Sequence[int] | None = None, store: StoreOptions | None = None,
                             progress: bool = True) -> ExtractionSummary:
    """Regenerate every conversation without features in `outputs.features`; write answers, features and (with
    `outputs.prepared`) the prepared dataset. The backend samples; `generation` gives the turns and the
    sample length. num_workers > 1 spawns num_workers - 1 processes."""
    from tqdm.auto import tqdm

    from ..data.fingerprint import tokenizer_fingerprint, tokenizer_record
    from ..data.thinking_mode import served_kwargs, thinking_mode

    gen_options = generation or GenerationOptions()
    max_turns, max_seq_len = gen_options.max_turns, gen_options.max_seq_len
    output, features_out = Path(outputs.conversations), Path(outputs.features)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.touch()
    info = VerifierIdentity.of_model(backend.model, backend.name, backend.spec.get("revision")).as_dict()
    aux = check_aux_indices(aux_indices or default_aux_indices(info["num_hidden_layers"]), info["num_hidden_layers"])
    fingerprint = tokenizer_fingerprint(backend.tokenizer)
    mode = served_kwargs(backend.chat_template_kwargs, thinking_mode(backend.tokenizer, backend.chat_template_kwargs))
    header = make_header(info, fingerprint, aux, canonical_dtype(dtype), **tokenizer_record(backend.tokenizer),
                         chat_template_kwargs=mode)  # the thinking mode the answers were generated and cut in
    ids = [str(c["id"]) for c in conversations]
    if len(set(ids)) != len(ids):
        dup = next(i for k, i in enumerate(ids) if i in ids[:k])
        raise ValueError(f"conversation id {dup!r} appears more than once; ids must be unique")
    done = settle_answers(output, features_out)
    todo = [c for c in conversations if str(c["id"]) not in done]
    # length-sorted batches (little padding), longest first (the stragglers at the end are short)
    template = Template(backend.tokenizer, backend.chat_template_kwargs)
    length: dict[str, int] = {}
    for c in todo:
        first = ConversationTurns(c, max_turns).next_prompt()
        length[str(c["id"])] = len(template.prompt(first, c.get("tools"))[1]) if first else 0
    todo.sort(key=lambda c: -length[str(c["id"])])
    if num_workers > 1:  # two batches per process at least: none idles long while another finishes a big one
        batch_size = max(1, min(batch_size, -(-len(todo) // (2 * num_workers))))
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    job: WorkerJob = {"aux": aux, "header": header, "features_out": str(features_out), "output": str(output),
                 "store": store or StoreOptions(), "max_turns": max_turns, "max_seq_len": max_seq_len}
    route: dict[str, Any] = {"engine": "transformers", "input": len(conversations),
                             "already_done": len(conversations) - len(todo), "conversations": 0, "generated": 0,
                             "workers": num_workers}
    bar = tqdm(total=len(todo), desc="regenerate+features", unit="conv", disable=not progress)
    sink = FeatureSink(features_out, header, store=job["store"], rank=0, world_size=max(1, num_workers))
    tokens = 0

    def tick(msg: WorkerReport) -> None:
        nonlocal tokens
        if "error" in msg:
            raise RuntimeError(f"regenerate worker {msg['rank']}: {msg['error']} (finished batches are saved; "
                               f"rerun to resume)")
        if "conversations" in msg:
            route["conversations"] += msg["conversations"]
            route["generated"] += msg["generated"]
            tokens += msg["tokens"]
            if msg["rank"] != 0:  # rank 0 writes through `sink`, which counts its own
                sink.count_others(msg["samples"], msg["tokens"], msg["skipped"])
            bar.update(msg["conversations"])
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - sink.start, 1e-9):.0f}", refresh=False)

    procs: list[BaseProcess] = []
    threads = torch.get_num_threads()
    if num_workers > 1:  # the cores are shared out: N processes x (threads / N), never oversubscribed
        torch.set_num_threads(max(1, threads // num_workers))
    try:
        if num_workers <= 1 or len(batches) <= 1:
            it = iter(batches)
            work(0, backend, job, lambda: next(it, None), tick, sink)
        else:
            procs, tasks, results = start_workers(backend, job, batches, num_workers)

            def next_batch() -> list[dict[str, Any]] | None:
                drain(results, procs, tick)
                return tasks.get()  # a batch, or this process's end marker

            work(0, backend, job, next_batch, tick, sink)
            while any(p.is_alive() for p in procs):
                drain(results, procs, tick, timeout=0.5)
            drain(results, procs, tick)
            bad = [p.exitcode for p in procs if p.exitcode]
            if bad:
                raise RuntimeError(f"a regenerate worker exited with code {bad[0]} (rerun to resume)")
    finally:
        sink.close()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        bar.close()
        torch.set_num_threads(threads)
    summary = sink.finish(ids, resumed_past=route["already_done"], route=route)
    done = settle_answers(output, features_out)
    missing = [i for i in ids if i not in done]
    if missing:
        raise RuntimeError(f"{len(missing)} conversations (e.g. {missing[0]!r}) have no features after the run")
    if outputs.prepared is not None:
        options = {"source": "regenerate --features-out", "max_seq_len": max_seq_len, "overlong": "truncate",
                   "max_turns": max_turns, "last_turn_only": False, "split_turns": False, "reasoning": "keep",
                   "tool_calls": "keep", "template_kwargs": backend.chat_template_kwargs or None}
        summary.route["prepared"] = write_prepared(features_out, Path(outputs.prepared), backend.tokenizer,
                                                   backend.name, ids, options)["counts"]
    return summary


# ------------------------------------------------------------ the route (`regenerate --engine transformers`)

@dataclass(frozen=True)
class InProcessOptions:
    """The in-process route's own options: where the verifier runs and in which dtype, conversations per batch, and
    the processes generating in parallel (with --features-out)."""

    device: str | None = None
    torch_dtype: str = "auto"
    batch_size: int = 8
    num_workers: int = 1

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("--engine transformers (the verifier in this process: --verifier)")
        group.add_argument("--device", default=None)
        group.add_argument("--batch-size", type=int, default=8, help="conversations per batch (--verifier)")
        group.add_argument("--num-workers", type=int, default=1,
                           help="processes generating in parallel (each a rank of --features-out; threads are split)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> InProcessOptions:
        return cls(args.device, args.torch_dtype, args.batch_size, args.num_workers)

    def close(self) -> None:
        """Nothing to release: the verifier belongs to the run."""


def run_route(job: RegenerateJob, options: InProcessOptions) -> int:
    """`regenerate --verifier V`: the verifier answers here, batched; with `job.features` its features, answers and
    (with `job.prepared`) the prepared dataset are written in the same pass."""
    assert job.verifier is not None, "the command selects this route without --endpoint, so with --verifier"
    gen = job.generation
    torch.manual_seed(gen.seed)
    backend = TransformersBackend(job.verifier, revision=job.revision, device=options.device,
                                  dtype=options.torch_dtype, max_new_tokens=gen.max_new_tokens,
                                  temperature=gen.temperature, top_p=gen.top_p,
                                  chat_template_kwargs=job.chat_template_kwargs)
    if job.features is None:
        stats = regenerate(job.conversations(), job.output, backend, batch_size=options.batch_size,
                           max_turns=gen.max_turns, retry_skipped=job.retry_skipped)
        report(stats, job)
        return 0
    outputs = job.feature_outputs()
    summary = regenerate_with_features(list(job.conversations()), outputs, backend, generation=gen,
                                       num_workers=options.num_workers, batch_size=options.batch_size,
                                       dtype=job.features_dtype,
                                       aux_indices=None if job.aux_indices is None else list(job.aux_indices),
                                       store=StoreOptions(job.samples_per_shard))
    route = summary.route
    print(f"regenerate: {route['conversations']} conversations written, {route['already_done']} already done, "
          f"{summary.written_tokens} sample tokens ({route['generated']} generated) in {summary.seconds:.1f}s "
          f"({summary.written_tokens / max(summary.seconds, 1e-9):.1f} tok/s, {route['workers']} worker(s)) "
          f"-> {outputs.conversations}, {outputs.features}" + (f", {outputs.prepared}" if outputs.prepared else ""),
          file=sys.stderr)
    return 0
