"""`eagle3-hf regenerate --verifier V --features-out DIR`: answers, features and the prepared dataset in one pass.

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
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from ..data import regenerate as plain
from ..data.prepare import NoLossTokens, apply_policies, assistant_spans, chat_template_source, turn_end
from ..data.regenerate import (
    ConversationTurns,
    GenerationOptions,
    RegenerateOutputs,
    TransformersBackend,
    completed_ids,
)
from ..data.token_boundaries import BoundaryInsideToken, encode, span_mask
from ..errors import UsageError
from ..verifier.family import check_aux_indices, default_aux_indices
from .interface import PreparedSample, SampleFeatures, VerifierIdentity
from .prepared_from_shards import write_prepared
from .records import FeatureHeader, canonical_dtype, make_header
from .store import merge_manifests
from .write import ExtractionSummary, FeatureSink, StoreOptions

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from transformers import PreTrainedTokenizerBase

    from ..verifier.generation import FeatureGenerator, Generated

_MARK = "EAGLE3ANSWERMARK"
# (prompt text, its ids, tail ids, tail loss mask): _Template.prompt
_Prompt = tuple[str, list[int], list[int], list[int]]


class _Job(TypedDict):
    """What every worker process writes with (sent to the spawned ones)."""

    aux: list[int]
    header: FeatureHeader
    features_out: str
    output: str
    store: StoreOptions
    max_turns: int | None
    max_seq_len: int | None


class _Sample(TypedDict):
    """One conversation's features, as ShardWriter.add takes them."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    verifier_greedy: torch.Tensor


class _Report(TypedDict, total=False):
    """A worker's message to the driver: a batch done, the worker's error, or its end."""

    rank: int
    conversations: int
    samples: int
    tokens: int
    skipped: dict[str, int]
    generated: int
    error: str
    finished: bool


# ---------------------------------------------------------------- template pieces

class _Template:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tok = tokenizer
        self.reasoning = "reasoning_content" in chat_template_source(tokenizer)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return apply_policies(messages, renders_reasoning=self.reasoning)  # what prepare renders

    def prompt(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> _Prompt:
        """(prompt text, its ids, tail ids, tail loss mask) for generating the next turn."""
        msgs = self.messages(messages)
        # tokenize=False: the rendered text
        text = cast(str, self.tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False))
        full = cast(str, self.tok.apply_chat_template(msgs + [{"role": "assistant", "content": _MARK}], tools=tools,
                                                      tokenize=False))
        if not full.startswith(text + _MARK):
            raise ValueError("the chat template adds text between the generation prompt and the answer")
        tail = full[len(text) + len(_MARK):]
        ids = encode(self.tok, text)
        tail_ids, tail_mask = span_mask(self.tok, tail, [(0, turn_end(tail))])  # where prepare ends the turn's loss
        return text, ids, tail_ids, tail_mask


# ---------------------------------------------------------------- one batch of conversations

def _run_batch(convs: list[dict[str, Any]], backend: TransformersBackend, gen: FeatureGenerator, template: _Template,
               max_turns: int | None,
               max_seq_len: int | None) -> tuple[list[tuple[dict[str, Any], _Sample | str]], int]:
    """(regenerated row, sample dict or refusal reason) per conversation, turn by turn as `regenerate`,
    and the number of tokens generated."""
    states = [ConversationTurns(c, max_turns) for c in convs]
    last: dict[int, tuple[int, _Prompt, Generated]] = {}
    generated = 0
    while True:
        asks = [(k, p) for k, s in enumerate(states) if (p := s.next_prompt()) is not None]
        if not asks:
            break
        pieces: dict[int, _Prompt] = {}
        for k, p in asks:
            try:
                pieces[k] = template.prompt(p, convs[k].get("tools"))
            except ValueError as e:
                raise ValueError(f"conversation {convs[k]['id']}: {e}") from None
        results = gen.generate([pieces[k][1] for k, _ in asks], [pieces[k][2] for k, _ in asks])
        for (k, p), r in zip(asks, results):
            content = cast(str, backend.tokenizer.decode(r.answer, skip_special_tokens=True))  # one sequence
            states[k].accept((content, None, None, r.finish_reason, len(r.answer) + (r.finish_reason == "stop")))
            last[k] = (len(p), pieces[k], r)
            generated += len(r.answer)
    out: list[tuple[dict[str, Any], _Sample | str]] = []
    for k, state in enumerate(states):
        row = state.row(backend.name)
        out.append((row, _sample(row, convs[k], last.get(k), template, max_seq_len)))
    return out, generated


def _sample(row: dict[str, Any], conv: dict[str, Any], last: tuple[int, _Prompt, Generated] | None,
            template: _Template, max_seq_len: int | None) -> _Sample | str:
    if last is None:
        return "no_generated_turn"
    n_prompt, (text, _prompt_ids, _tail, tail_mask), r = last
    if len(row["messages"]) != n_prompt + 1:
        return "messages_after_last_turn"
    try:
        _, spans = assistant_spans(template.messages(row["messages"]), template.tok, tools=conv.get("tools"),
                                   sample_id=str(conv["id"]))
    except NoLossTokens:
        spans = []
    except ValueError:
        return "template_rewrites_history"
    try:  # earlier turns' spans, as far as they lie in the prompt
        _, prompt_mask = span_mask(template.tok, text, [(a, min(b, len(text))) for a, b in spans if a < len(text)],
                                   str(conv["id"]))
    except BoundaryInsideToken:
        return "boundary_inside_token"
    mask = prompt_mask + [1] * len(r.answer) + tail_mask
    ids = r.input_ids
    if len(ids) != len(mask):
        raise RuntimeError(f"conversation {conv['id']}: {len(ids)} tokens but {len(mask)} mask entries")
    n = len(ids) if max_seq_len is None else min(len(ids), max_seq_len)
    if not any(mask[:n]):
        return "no_loss_tokens"
    # generated with features on
    assert r.aux_hidden_states is not None and r.last_hidden_state is not None and r.verifier_greedy is not None
    return {"input_ids": torch.tensor(ids[:n]), "loss_mask": torch.tensor(mask[:n]),
            "aux_hidden_states": r.aux_hidden_states[:n].float(), "last_hidden_state": r.last_hidden_state[:n].float(),
            "verifier_greedy": r.verifier_greedy[:n]}


# ---------------------------------------------------------------- one rank

def _pending_path(output: Path, rank: int) -> Path:
    return output.with_name(f"{output.name}.r{rank:03d}.pending")


def _work(rank: int, backend: TransformersBackend, job: _Job, next_batch: Callable[[], list[dict[str, Any]] | None],
          report: Callable[[_Report], None], sink: FeatureSink | None = None) -> None:
    """Process batches until next_batch() returns None; report(dict) after each. Writes through `sink` (the
    driver's, rank 0) or a sink of its own rank (a spawned worker); closes it at the end."""
    gen = backend.generator(job["aux"])
    template = _Template(backend.tokenizer)
    sink = sink or FeatureSink(job["features_out"], job["header"], store=job["store"], rank=rank)
    pending = open(_pending_path(Path(job["output"]), rank), "ab")
    try:
        while (batch := next_batch()) is not None:
            done, generated = _run_batch(batch, backend, gen, template, job["max_turns"], job["max_seq_len"])
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


def _die_with_parent() -> None:
    """Linux: a spawned worker is killed when its parent dies (no orphan keeps writing a rank's shards)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _spawned_worker(rank: int, spec: dict[str, Any], job: _Job, tasks: Queue[list[dict[str, Any]] | None],
                    results: Queue[_Report], threads: int) -> None:
    _die_with_parent()
    torch.set_num_threads(threads)
    try:
        backend = TransformersBackend(**spec)

        def next_batch() -> list[dict[str, Any]] | None:
            return tasks.get()

        _work(rank, backend, job, next_batch, results.put)
    except BaseException as e:  # reported to the parent, which fails the run
        results.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})
        raise UsageError(1) from None
    results.put({"rank": rank, "finished": True})


# ---------------------------------------------------------------- resume bookkeeping

def _journaled_ids(features_out: Path) -> set[str]:
    try:
        manifest = merge_manifests(features_out, write=False)
    except FileNotFoundError:
        return set()
    done = {s["id"] for s in manifest["samples"]}
    for ids in manifest.get("skipped_ids", {}).values():
        done.update(ids)
    return done


def _settle_answers(output: Path, features_out: Path) -> set[str]:
    """Move answers whose shard is journaled from the pending files to OUTPUT; drop the rest (redone)."""
    done = _journaled_ids(features_out)
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


# ---------------------------------------------------------------- driver

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

    gen_options = generation or GenerationOptions()
    max_turns, max_seq_len = gen_options.max_turns, gen_options.max_seq_len
    output, features_out = Path(outputs.conversations), Path(outputs.features)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.touch()
    info = VerifierIdentity.of_model(backend.model, backend.name, backend.spec.get("revision")).as_dict()
    aux = check_aux_indices(aux_indices or default_aux_indices(info["num_hidden_layers"]), info["num_hidden_layers"])
    fingerprint = tokenizer_fingerprint(backend.tokenizer)
    header = make_header(info, fingerprint, aux, canonical_dtype(dtype), **tokenizer_record(backend.tokenizer))
    ids = [str(c["id"]) for c in conversations]
    if len(set(ids)) != len(ids):
        dup = next(i for k, i in enumerate(ids) if i in ids[:k])
        raise ValueError(f"conversation id {dup!r} appears more than once; ids must be unique")
    done = _settle_answers(output, features_out)
    todo = [c for c in conversations if str(c["id"]) not in done]
    # length-sorted batches (little padding), longest first (the stragglers at the end are short)
    template = _Template(backend.tokenizer)
    length: dict[str, int] = {}
    for c in todo:
        first = ConversationTurns(c, max_turns).next_prompt()
        length[str(c["id"])] = len(template.prompt(first, c.get("tools"))[1]) if first else 0
    todo.sort(key=lambda c: -length[str(c["id"])])
    if num_workers > 1:  # two batches per process at least: none idles long while another finishes a big one
        batch_size = max(1, min(batch_size, -(-len(todo) // (2 * num_workers))))
    batches = [todo[i:i + batch_size] for i in range(0, len(todo), batch_size)]
    job: _Job = {"aux": aux, "header": header, "features_out": str(features_out), "output": str(output),
                 "store": store or StoreOptions(), "max_turns": max_turns, "max_seq_len": max_seq_len}
    route: dict[str, Any] = {"engine": "transformers", "input": len(conversations),
                             "already_done": len(conversations) - len(todo), "conversations": 0, "generated": 0,
                             "workers": num_workers}
    bar = tqdm(total=len(todo), desc="regenerate+features", unit="conv", disable=not progress)
    sink = FeatureSink(features_out, header, store=job["store"], rank=0, world_size=max(1, num_workers))
    tokens = 0

    def tick(msg: _Report) -> None:
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
            _work(0, backend, job, lambda: next(it, None), tick, sink)
        else:
            procs, tasks, results = _start_workers(backend, job, batches, num_workers)

            def next_batch() -> list[dict[str, Any]] | None:
                _drain(results, procs, tick)
                return tasks.get()  # a batch, or this process's end marker

            _work(0, backend, job, next_batch, tick, sink)
            while any(p.is_alive() for p in procs):
                _drain(results, procs, tick, timeout=0.5)
            _drain(results, procs, tick)
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
    done = _settle_answers(output, features_out)
    missing = [i for i in ids if i not in done]
    if missing:
        raise RuntimeError(f"{len(missing)} conversations (e.g. {missing[0]!r}) have no features after the run")
    if outputs.prepared is not None:
        options = {"source": "regenerate --features-out", "max_seq_len": max_seq_len, "overlong": "truncate",
                   "max_turns": max_turns, "last_turn_only": False, "split_turns": False, "reasoning": "keep",
                   "tool_calls": "keep", "template_kwargs": None}
        summary.route["prepared"] = write_prepared(features_out, Path(outputs.prepared), backend.tokenizer,
                                                   backend.name, ids, options)["counts"]
    return summary


def _start_workers(backend: TransformersBackend, job: _Job, batches: list[list[dict[str, Any]]], num_workers: int
                   ) -> tuple[list[BaseProcess], Queue[list[dict[str, Any]] | None], Queue[_Report]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for b in batches:
        tasks.put(b)
    for _ in range(num_workers):
        tasks.put(None)  # one end marker per process, this one included
    threads = torch.get_num_threads()
    procs: list[BaseProcess] = [
        ctx.Process(target=_spawned_worker, args=(r, backend.spec, job, tasks, results, threads), daemon=True)
        for r in range(1, num_workers)]
    for p in procs:
        p.start()
    return procs, tasks, results


def _drain(results: Queue[_Report], procs: list[BaseProcess], tick: Callable[[_Report], None],
           timeout: float | None = None) -> None:
    while True:
        try:
            msg = results.get(timeout=timeout) if timeout else results.get_nowait()
        except queue.Empty:
            return
        tick(msg)
        timeout = None


# ------------------------------------------------------------ CLI (`eagle3-hf regenerate`, with or without features)

def add_arguments(parser: argparse.ArgumentParser) -> None:
    plain.add_arguments(parser)
    feats = parser.add_argument_group("features in the same pass (--verifier only; replaces prepare + extract)")
    feats.add_argument("--features-out", default=None,
                       help="also write the verifier's features of prompt + answer here, as `extract` writes them")
    feats.add_argument("--prepared-out", default=None, help="and the prepared dataset (`prepare`'s output) here")
    feats.add_argument("--num-workers", type=int, default=1,
                       help="processes generating in parallel (each a rank of --features-out; threads are split)")
    feats.add_argument("--features-dtype", default="bf16", help="bf16 (default), fp8 (e4m3 + per-row scale) or fp32")
    feats.add_argument("--aux-layers", default=None, help="three output_hidden_states indices (default 2,N//2,N-3)")
    feats.add_argument("--max-seq-len", type=int, default=None, help="truncate samples to this many tokens")
    feats.add_argument("--samples-per-shard", type=int, default=64)
    from .vllm_generation import add_arguments as add_vllm_arguments

    add_vllm_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from . import vllm_generation

    if vllm_generation.chosen(args):
        return vllm_generation.run(args)
    if not args.features_out:
        return plain.run(args)
    if not args.verifier:
        raise ValueError("regenerate: --features-out needs the in-process --verifier (an endpoint returns no "
                         "hidden states)")
    from ..data.conversations import load_conversations

    torch.manual_seed(args.seed)
    backend = TransformersBackend(args.verifier, revision=args.revision, device=args.device, dtype=args.torch_dtype,
                                  max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    conversations = list(load_conversations(args.input, limit=args.limit, split=args.split))
    aux = [int(x) for x in args.aux_layers.split(",")] if args.aux_layers else None
    outputs = RegenerateOutputs(Path(args.output), Path(args.features_out),
                                Path(args.prepared_out) if args.prepared_out else None)
    generation = GenerationOptions(args.max_new_tokens, args.temperature, args.top_p, args.seed, args.max_turns,
                                   args.max_seq_len)
    summary = regenerate_with_features(conversations, outputs, backend, generation=generation,
                                       num_workers=args.num_workers, batch_size=args.batch_size,
                                       dtype=args.features_dtype, aux_indices=aux,
                                       store=StoreOptions(args.samples_per_shard))
    route = summary.route
    print(f"regenerate: {route['conversations']} conversations written, {route['already_done']} already done, "
          f"{summary.written_tokens} sample tokens ({route['generated']} generated) in {summary.seconds:.1f}s "
          f"({summary.written_tokens / max(summary.seconds, 1e-9):.1f} tok/s, {route['workers']} worker(s)) "
          f"-> {args.output}, {args.features_out}" + (f", {args.prepared_out}" if args.prepared_out else ""),
          file=sys.stderr)
    return 0
