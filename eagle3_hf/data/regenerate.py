"""Let the verifier rewrite the assistant turns, so the drafter learns the verifier's own distribution.

Each assistant turn is regenerated from the conversation up to it, earlier turns already regenerated
(turn by turn, as the verifier would have answered); a conversation ending on a user or tool message
gets a final answer. Assistant turns that call tools are kept verbatim (the tool results that follow
depend on them). Two backends (regenerate_backends.py): in-process transformers (batched, left padding) or an
OpenAI-compatible `/v1/chat/completions` endpoint (SGLang, vLLM) with concurrent requests and retries. This module
walks the conversations (`ConversationTurns`), drives a backend over them, holds what the command hands a route
(`RegenerateJob`) and is the endpoint route (`EndpointOptions`, `run_route`); the command, its engine choices and
the in-process route are in features/ (commands/regenerate.py, generators.py).

Output is JSONL, one finished conversation per line, flushed and fsync'd; a restart skips the ids
already there, so a killed run resumes with nothing lost or duplicated. A conversation the server rejects for
good (HTTP 400/413/422) is skipped and recorded by id beside the output (regenerate_summary.py), and the run
waits for a server still loading (server_wait.py). Reasoning a server's reasoning parser returns
(`reasoning_content` / `reasoning`) is kept on the answer, for `prepare` to train.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EndpointError, json_object
from .answers_file import ConversationWriter, completed_ids, put_in_input_order  # noqa: F401 (their home for other importers)
from .regenerate_backends import Completion, EndpointBackend, TransformersBackend
from .regenerate_summary import (
    MAX_CONSECUTIVE_REJECTS,
    MAX_REJECT_SHARE,
    SHARE_AFTER,
    RegenerateSummary,
    RejectedRequest,
    RejectLimits,
    summary_path,
)
from .server_wait import DEFAULT_WAIT_S


@dataclass(frozen=True)
class RegenerateOutputs:
    """Where `regenerate --features-out` writes: the answered conversations (--output), the features
    (--features-out) and, optionally, the prepared dataset (--prepared-out)."""

    conversations: Path
    features: Path
    prepared: Path | None = None


@dataclass(frozen=True)
class GenerationOptions:
    """How answers are generated and cut into samples: sampling (vLLM's route; the in-process one samples as its
    `TransformersBackend` was built), the turns answered per conversation and the tokens kept per sample."""

    max_new_tokens: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_turns: int | None = None
    max_seq_len: int | None = None


class ConversationTurns:
    """Walks one conversation: hands out the prompt of each turn to (re)generate, takes the answers."""

    def __init__(self, conv: dict, max_turns: int | None = None):
        self.conv, self.src, self.pos = conv, conv["messages"], 0
        self.out: list[dict] = []  # the conversation as regenerated so far
        self.finish: list[str] = []
        self.answered_tail = False
        self.max_turns = max_turns

    def next_prompt(self) -> list[dict] | None:
        if self.max_turns is not None and len(self.finish) >= self.max_turns:
            return None  # the rest of the source answered turns the verifier never wrote: cut here
        while self.pos < len(self.src):
            msg = self.src[self.pos]
            asks = any(m["role"] in ("user", "tool") for m in self.out)
            if msg["role"] == "assistant" and not msg.get("tool_calls") and asks:
                return list(self.out)
            self.out.append(msg)
            self.pos += 1
        if self.out and self.out[-1]["role"] in ("user", "tool") and not self.answered_tail:
            return list(self.out)
        return None

    def accept(self, completion: Completion) -> None:
        content, reasoning, tool_calls, finish, _ = completion
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        self.out.append(msg)
        self.finish.append(finish)
        if self.pos < len(self.src):
            self.pos += 1  # replaces the source turn
        else:
            self.answered_tail = True

    def row(self, model: str) -> dict:
        row = {"id": self.conv["id"], "messages": self.out}
        if self.conv.get("tools") is not None:
            row["tools"] = self.conv["tools"]
        row["regenerated"] = {"model": model, "finish_reasons": self.finish}
        return row


# ---------------------------------------------------------------- drivers

def _run_endpoint(todo: list[dict], backend: EndpointBackend, write: Callable, concurrency: int, tick: Callable,
                  max_turns: int | None, skip: Callable[[str, str], None], limits: RejectLimits) -> None:
    """`concurrency` conversations in flight, the next one sent as one finishes: a run that stops (the server rejects
    too many, another failure, Ctrl-C) has sent at most `concurrency` requests past the one that stopped it, however
    far the workers would have run ahead of the results (a whole queue of instant rejections, before)."""
    def one(conv: dict) -> tuple[dict, int]:
        state, tokens = ConversationTurns(conv, max_turns), 0
        while (prompt := state.next_prompt()) is not None:
            completion = backend.complete(prompt, conv.get("tools"))
            tokens += completion[4]
            state.accept(completion)
        return state.row(backend.name), tokens

    results = _Results(write, tick, skip, limits, len(todo))
    queue = iter(todo)
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        in_flight: dict[Future, str] = {}

        def fill() -> None:
            while len(in_flight) < max(1, concurrency) and results.failed is None:
                conv = next(queue, None)
                if conv is None:
                    return
                in_flight[pool.submit(one, conv)] = conv["id"]

        fill()
        while in_flight:  # Ctrl-C: only the requests in flight are waited for (the pool's exit)
            finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for fut in finished:
                results.take(in_flight.pop(fut), fut)
            fill()
    if results.failed is not None:
        conv_id, error = results.failed
        raise EndpointError(f"conversation {conv_id}: {error} (finished ones are saved; rerun to resume)")


class _Results:
    """Write conversations as they finish; skip those the server rejects (recorded by `skip`); on the first other
    failure, or when the rejections pass `limits` (in a row, or their share), stop sending (`failed`), keep what
    finished."""

    def __init__(self, write: Callable, tick: Callable, skip: Callable[[str, str], None], limits: RejectLimits,
                 total: int) -> None:
        self.write, self.tick, self.skip, self.limits, self.total = write, tick, skip, limits, total
        self.failed: tuple[str, BaseException] | None = None
        self.answered = self.rejected = self.in_a_row = 0

    def _stop(self, why: str, last: str) -> EndpointError:
        return EndpointError(f"{why}{last}. Check --model and --max-new-tokens against its context length "
                             f"({self.answered} answered, {self.rejected} rejected, "
                             f"{self.total - self.answered - self.rejected} not finished)")

    def take(self, conv_id: str, fut: Future) -> None:
        try:
            row, tokens = fut.result()
        except RejectedRequest as e:
            self.skip(conv_id, e.reason)
            self.rejected += 1
            self.in_a_row += 1
            why = self.limits.exceeded(self.answered, self.rejected, self.in_a_row) if self.failed is None else None
            if why:
                self.failed = (conv_id, self._stop(why, f"; last: {e}"))
            return
        except Exception as e:
            if self.failed is None:
                self.failed = (conv_id, e)
            return
        self.write(row)
        self.tick(row, tokens)
        self.answered += 1
        self.in_a_row = 0
        why = self.limits.exceeded(self.answered, self.rejected, self.in_a_row) if self.failed is None else None
        if why:  # the share is first judged at its SHARE_AFTER-th result, which may be an answer
            self.failed = (conv_id, self._stop(why, ""))


def _run_batched(todo: list[dict], backend: TransformersBackend, write: Callable, batch_size: int,
                 tick: Callable, max_turns: int | None) -> None:
    """Keep up to batch_size conversations in flight; each step generates one turn for each of them."""
    pending, exhausted = iter(todo), False
    active: list[ConversationTurns] = []
    tokens: Counter = Counter()
    while True:
        while True:  # fill the batch; finished conversations leave it and are written at once
            while len(active) < batch_size and not exhausted:
                conv = next(pending, None)
                exhausted = conv is None
                if conv is not None:
                    active.append(ConversationTurns(conv, max_turns))
            needing, prompts = [], []
            for state in active:
                prompt = state.next_prompt()
                if prompt is None:
                    row = state.row(backend.name)
                    write(row)
                    tick(row, tokens.pop(state.conv["id"], 0))
                else:
                    needing.append(state)
                    prompts.append((prompt, state.conv.get("tools")))
            changed, active = len(needing) < len(active), needing
            if not changed or exhausted:
                break
        if not active:
            return
        for state, completion in zip(active, backend.generate(prompts)):
            tokens[state.conv["id"]] += completion[4]
            state.accept(completion)


def regenerate(conversations: Iterable[dict], output: str | Path, backend: TransformersBackend | EndpointBackend, *,
               concurrency: int = 16,
               batch_size: int = 8, max_turns: int | None = None, progress: bool = True,
               retry_skipped: bool = False, limits: RejectLimits | None = None) -> dict:
    """Regenerate every conversation not yet in `output` (JSONL, appended). Returns counts.

    `max_turns` keeps at most that many assistant turns per conversation (the rest is cut off). Conversations the
    server rejected in an earlier run (the summary beside `output`) are not asked again unless `retry_skipped`;
    `limits` (default RejectLimits()) stops a run whose server rejects too many.
    """
    from tqdm.auto import tqdm

    conversations = list(conversations)
    seen: set[str] = set()
    for conv in conversations:
        if conv["id"] in seen:
            raise ValueError(f"input: duplicate conversation id {conv['id']!r}; ids must be unique to resume")
        seen.add(conv["id"])
    done = completed_ids(output)
    summary = RegenerateSummary(output)
    earlier = set() if retry_skipped else set(summary.skipped) - done
    todo = [c for c in conversations if c["id"] not in done and c["id"] not in earlier]
    stats: dict[str, Any] = {"input": len(conversations), "already_done": len(done & seen),
                             "skipped_before": len(earlier & seen), "written": 0, "turns": 0, "tokens": 0,
                             "finish_reasons": Counter(), "skipped": {}, "summary": str(summary_path(output))}
    start = time.monotonic()
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress)

    def tick(row: dict, tokens: int) -> None:
        stats["written"] += 1
        stats["turns"] += len(row["regenerated"]["finish_reasons"])
        stats["tokens"] += tokens
        stats["finish_reasons"].update(row["regenerated"]["finish_reasons"])
        summary.answered(str(row["id"]), row["regenerated"]["finish_reasons"])
        bar.update(1)
        bar.set_postfix(tok_s=f"{stats['tokens'] / max(time.monotonic() - start, 1e-9):.1f}", refresh=False)

    def skip(conv_id: str, reason: str) -> None:
        stats["skipped"][conv_id] = reason
        summary.skip(conv_id, reason)
        bar.update(1)

    write = ConversationWriter(output)
    try:
        if isinstance(backend, TransformersBackend):
            _run_batched(todo, backend, write, batch_size, tick, max_turns)
        else:
            _run_endpoint(todo, backend, write, concurrency, tick, max_turns, skip, limits or RejectLimits())
    finally:
        write.close()
        bar.close()
        stats["seconds"] = time.monotonic() - start
        stats["cut_at_max_new_tokens"] = stats["finish_reasons"].get("length", 0)
        summary.save(model=backend.name, max_new_tokens=backend.max_new_tokens,
                     chat_template_kwargs=backend.chat_template_kwargs or None,  # the thinking mode asked in
                     last_run={k: stats[k] for k in ("input", "already_done", "skipped_before", "written", "turns",
                                                     "tokens", "finish_reasons", "seconds")})
    put_in_input_order(output, [str(c["id"]) for c in conversations])  # reproducible: the same input, the same file
    if todo and stats["skipped"] and not stats["written"]:
        first = next(iter(stats["skipped"].items()))
        raise EndpointError(f"the server rejected every conversation asked ({len(stats['skipped'])}; e.g. "
                            f"conversation {first[0]}: {first[1]}); ids and errors in {summary.path}")
    return stats


@dataclass(frozen=True)
class RegenerateJob:
    """What `regenerate` hands the route it runs (features/generators.py), read once from the command's shared
    flags: the conversations (--input, --split, --limit), where the answers go (and with `features` the features,
    with `prepared` the prepared dataset), how answers are generated, the verifier (None: a server answers), the
    thinking mode, and the features' own settings for a route that writes them."""

    input: str
    output: Path
    generation: GenerationOptions
    split: str = "train"
    limit: int | None = None
    features: Path | None = None
    prepared: Path | None = None
    verifier: str | None = None
    endpoint: str | None = None
    revision: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    retry_skipped: bool = False
    aux_indices: tuple[int, ...] | None = None
    features_dtype: str = "bf16"
    samples_per_shard: int = 64

    def conversations(self) -> Iterable[dict]:
        from .conversations import load_conversations

        return load_conversations(self.input, limit=self.limit, split=self.split)

    def feature_outputs(self) -> RegenerateOutputs:
        """Where a route that writes features writes (`features` given: the command checked it)."""
        assert self.features is not None, "a route writing features runs with --features-out"
        return RegenerateOutputs(self.output, self.features, self.prepared)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """`regenerate`'s flags every route reads: the conversations, the answering side (a verifier here or a server),
    the verifier's revision and dtype, and sampling. Each route's own flags are its options class's group."""
    parser.add_argument("--input", required=True,
                        help="JSONL/JSON file, saved dataset dir, Hub dataset id, or 'default'")
    parser.add_argument("--split", default="train")
    parser.add_argument("--output", required=True, help="output JSONL (appended; existing ids are skipped)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-turns", type=int, default=None,
                        help="regenerate at most N assistant turns per conversation and cut the rest")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--verifier", help="in-process transformers verifier: name, Hub id or path")
    src.add_argument("--endpoint", help="OpenAI-compatible server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--retry-skipped", action="store_true",
                        help="ask again the conversations the server rejected (HTTP 400/413/422) in an earlier run "
                             "(they are listed in the summary beside --output)")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--torch-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the verifier's compute dtype (auto: the checkpoint's)")
    parser.add_argument("--max-new-tokens", type=int, default=1024,
                        help="token budget per answer; a thinking model's reasoning counts: give it room (e.g. "
                             "32768); answers cut at it are counted and listed in the summary")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                        help='the chat template\'s kwargs for every prompt, e.g. \'{"thinking": false}\' (Kimi-K2.x) '
                             'or \'{"enable_thinking": false}\' (Qwen3): the thinking mode the answers are generated '
                             "in (sent as the request's chat_template_kwargs to --endpoint); give prepare the same")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of regenerate without its feature routes: the shared ones and the endpoint's group."""
    add_common_arguments(parser)
    EndpointOptions.add_arguments(parser)


@dataclass(frozen=True)
class EndpointOptions:
    """The endpoint route's own options (`regenerate --endpoint URL`): the served model's name, where its API key
    is (an environment variable, never printed), requests in flight, seconds and retries per request, how long to
    wait for a server still loading, and when its rejections stop the run."""

    model: str | None = None
    api_key_env: str = "OPENAI_API_KEY"
    concurrency: int = 16
    timeout: float = 600.0
    max_retries: int = 5
    wait_for_server: float = DEFAULT_WAIT_S
    limits: RejectLimits = RejectLimits()

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("--endpoint URL (any OpenAI-compatible server answers: SGLang, vLLM, ...)")
        group.add_argument("--model", help="model name for --endpoint")
        group.add_argument("--api-key-env", default="OPENAI_API_KEY",
                           help="env var holding the API key (never printed)")
        group.add_argument("--concurrency", type=int, default=16, help="parallel requests (--endpoint)")
        group.add_argument("--timeout", type=float, default=600.0, help="seconds per request (--endpoint)")
        group.add_argument("--max-retries", type=int, default=5, help="retries with backoff (--endpoint)")
        group.add_argument("--wait-for-server", type=float, default=DEFAULT_WAIT_S, metavar="SECONDS",
                           help="wait this long for a server still loading (GET /health or /v1/models) before the "
                                "first request (--endpoint; 0: do not wait)")
        group.add_argument("--max-consecutive-rejects", type=int, default=MAX_CONSECUTIVE_REJECTS, metavar="N",
                           help="stop the run when the server rejects N conversations in a row (--endpoint; the "
                                "settings are wrong, not the samples; 0: never) (default: %(default)s)")
        group.add_argument("--max-reject-share", type=float, default=MAX_REJECT_SHARE, metavar="SHARE",
                           help=f"stop the run when more than this share of the results are rejections, judged once "
                                f"{SHARE_AFTER} conversations were answered or rejected (--endpoint; 1: never) "
                                "(default: %(default)s)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EndpointOptions:
        return cls(args.model, args.api_key_env, args.concurrency, args.timeout, args.max_retries,
                   args.wait_for_server, RejectLimits(args.max_consecutive_rejects, args.max_reject_share))

    def close(self) -> None:
        """Nothing to release."""


def run_route(job: RegenerateJob, options: EndpointOptions) -> int:
    """`regenerate --endpoint URL`: the server answers every conversation (no hidden states)."""
    if not options.model:
        print("regenerate: --endpoint needs --model (the served model's name)", file=sys.stderr)
        return 2
    assert job.endpoint is not None, "the command selects this route with --endpoint"
    gen = job.generation
    backend = EndpointBackend(job.endpoint, options.model, api_key=os.environ.get(options.api_key_env),
                              timeout=options.timeout, max_retries=options.max_retries,
                              chat_template_kwargs=job.chat_template_kwargs, max_new_tokens=gen.max_new_tokens,
                              temperature=gen.temperature, top_p=gen.top_p)
    backend.wait_for_server(options.wait_for_server)
    stats = regenerate(job.conversations(), job.output, backend, concurrency=options.concurrency,
                       max_turns=gen.max_turns, retry_skipped=job.retry_skipped, limits=options.limits)
    report(stats, job)
    return 0


def report(stats: dict, job: RegenerateJob) -> None:
    """A run's counts on stderr, and what the user may want to do about its cut or skipped turns."""
    print(f"regenerate: {stats['written']} conversations written, {stats['already_done']} already done, "
          f"{stats['turns']} turns, {stats['tokens']} tokens in {stats['seconds']:.1f}s "
          f"({stats['tokens'] / max(stats['seconds'], 1e-9):.1f} tok/s) -> {job.output}", file=sys.stderr)
    cut = stats["cut_at_max_new_tokens"]
    if cut:
        print(f"regenerate: {cut} turns hit --max-new-tokens {job.generation.max_new_tokens} and are cut short (ids "
              f"in {stats['summary']}; a thinking model needs room for its reasoning)", file=sys.stderr)
    if stats["skipped"]:
        print(f"regenerate: skipped {len(stats['skipped'])} conversations the server rejected (ids and errors in "
              f"{stats['summary']}; --retry-skipped asks them again)", file=sys.stderr)
    if stats["skipped_before"]:
        print(f"regenerate: {stats['skipped_before']} conversations rejected in an earlier run not asked again "
              f"(--retry-skipped)", file=sys.stderr)
