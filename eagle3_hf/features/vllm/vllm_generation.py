"""`eagle3-hf regenerate --engine vllm --features-out F [--prepared-out P]`: vLLM writes the training data end to end.

One runner process, one engine load (engines/vllm/vllm_extract_runner.py with a generate phase):

1. generate: vLLM answers every conversation not yet in --output, turn by turn as `regenerate` does
   (ConversationTurns; the prompt rendered and tokenized here exactly as the in-process backend renders it;
   greedy, or --temperature/--top-p with a per-turn seed from --seed and the conversation id, so batching
   never changes a sample). Each finished conversation is appended to --output (fsync'd) at once.
2. prepare: the answered conversations (--output, in its order) go through `prepare`'s own code
   (prepare_conversations, build_meta) in this process: the prepared dataset is exactly what `prepare
   --input OUTPUT` makes, saved to --prepared-out.
3. extract: those samples are prefilled through the same engine with the extraction connector and mapped
   and written exactly as `extract --engine vllm` does (vllm_spec.VllmFeatureSpec: aux states at the aux
   ids, the verifier's final norm on vLLM's id N for `last_hidden_state`, its lm_head for `verifier_greedy`,
   the same checks, shards, manifest and source "vllm").

Why prefill again instead of reusing the generation pass's states: vLLM saves a generated request's
states for prompt + output tokens except the last, so the answer's last token and the template's tail after
it (ChatML's `<|im_end|>\\n`) have none; and `prepare` tokenizes the decoded answer again, which can give
other ids than the generated ones. Prefilling the prepared samples makes the features exactly
`extract --engine vllm`'s on those samples (bit-equal on an uninterrupted run with the same batching and
--max-model-len), at the price of one prefill per sample.

Resume (the same command): answers in --output are kept and never generated again; a sample is done once
its shard is journaled (ShardWriter); a kill at any point loses and duplicates nothing. Conversations that
`prepare` refuses (no loss tokens) stay in --output and have no sample, as under prepare + extract.
One process (rank 0); vLLM's own --tensor-parallel-size for more devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ...data.regenerate import (
    ConversationTurns,
    ConversationWriter,
    GenerationOptions,
    RegenerateJob,
    RegenerateOutputs,
    completed_ids,
)
from ...data.thinking_mode import split_emitted
from ...engines.vllm.vllm_args import add_engine_arguments, add_run_arguments
from ..write import ExtractionSummary, StoreOptions
from .vllm_spec import VllmOptions

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

    from ...engines.vllm.vllm_env import VllmExtraction

GENERATE_CHUNK = 256  # conversations in flight per round series: a kill loses at most these answers


def eos_ids(path: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end an answer: the generation config's eos ids and the tokenizer's (as the in-process backend)."""
    from transformers import GenerationConfig

    from ...verifier.loading import load_config

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json: the model config's
        eos = getattr(load_config(path), "eos_token_id", None)
    found = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        found.add(tokenizer.eos_token_id)
    if not found:
        raise ValueError(f"{path}: no eos token id in its generation config or tokenizer")
    return sorted(int(t) for t in found)


def prompt_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[Any] | None) -> str:
    """The next turn's prompt, rendered as regenerate's in-process backend does."""
    return cast(str, tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False))


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
               tools: list[Any] | None) -> list[int]:
    """The next turn's prompt, rendered and tokenized as regenerate's in-process backend does."""
    return list(tokenizer(prompt_text(tokenizer, messages, tools), add_special_tokens=False)["input_ids"])


def turn_seed(seed: int, conv_id: str, turn: int) -> int:
    """A sampling seed per (conversation, turn): the same answer whatever batch it runs in, after a resume too."""
    return (zlib.crc32(f"{conv_id}\0{turn}".encode()) ^ (seed * 0x9E3779B1)) & 0x7FFFFFFF


def generate_answers(run: VllmExtraction, todo: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase,
                     eos: list[int], write: ConversationWriter, name: str, seed: int,
                     max_turns: int | None) -> dict[str, int]:
    """Phase 1: every conversation of `todo` answered turn by turn (one generate round per turn, GENERATE_CHUNK
    conversations at a time) and appended to --output as soon as it is finished. Returns counts."""
    stats = {"conversations": 0, "turns": 0, "generated": 0}
    for start in range(0, len(todo), GENERATE_CHUNK):
        active = [ConversationTurns(c, max_turns) for c in todo[start:start + GENERATE_CHUNK]]
        while active:
            asks = []
            for state in active:
                prompt = state.next_prompt()
                if prompt is None:
                    write(state.row(name))
                    stats["conversations"] += 1
                else:
                    asks.append((state, prompt))
            active = [state for state, _ in asks]
            if not asks:
                break
            texts = [prompt_text(tokenizer, p, s.conv.get("tools")) for s, p in asks]
            answers = run.generate([(k, list(tokenizer(texts[k], add_special_tokens=False)["input_ids"]),
                                     turn_seed(seed, str(s.conv["id"]), len(s.finish)))
                                    for k, (s, p) in enumerate(asks)])
            for k, (state, _) in enumerate(asks):
                out, finish = list(answers[k]["output_ids"]), str(answers[k]["finish_reason"])
                if finish == "stop" and out and out[-1] in eos:
                    out = out[:-1]  # the in-process backend's answer never holds its stop token
                text = cast(str, tokenizer.decode(out, skip_special_tokens=True))
                answer, reasoning = split_emitted(texts[k], text)  # reasoning after an opened block kept apart
                state.accept((answer, reasoning, None, finish, len(out) + (finish == "stop")))
                stats["turns"] += 1
                stats["generated"] += len(out)
    return stats


def prepare_answers(output: Path, wanted: set[str], tokenizer: PreTrainedTokenizerBase, tokenizer_name: str,
                    max_seq_len: int | None) -> tuple[datasets.Dataset, dict[str, Any]]:
    """Phase 2: `prepare`'s dataset and meta for the answered conversations of this input (--output's order)."""
    from ...data.conversations import load_conversations
    from ...data.prepare import build_meta, new_stats, prepare_conversations

    convs = [c for c in load_conversations(str(output)) if str(c["id"]) in wanted]
    stats = new_stats()
    ds = prepare_conversations(convs, tokenizer, max_seq_len=max_seq_len, overlong="truncate", stats=stats)
    options = {"source": "regenerate --engine vllm", "input": str(output), "max_seq_len": max_seq_len,
               "overlong": "truncate", "last_turn_only": False, "split_turns": False, "reasoning": "keep",
               "tool_calls": "keep", "template_kwargs": None, "text": False}
    return ds, build_meta(tokenizer, tokenizer_name, stats, options)


def default_max_model_len(convs: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, max_new_tokens: int,
                          max_turns: int | None, limit: int | None) -> int:
    """vLLM's context when --max-model-len is not given, an upper bound: the longest source conversation rendered
    whole (its answers included, which the new ones replace) plus max_new_tokens and some template per turn to
    generate, within the model's positions."""
    longest = 0
    for c in convs:
        turns = sum(1 for m in c["messages"] if m["role"] == "assistant" and not m.get("tool_calls"))
        turns = max(1, turns if max_turns is None else min(turns, max_turns))
        whole = prompt_ids(tokenizer, c["messages"], c.get("tools"))
        longest = max(longest, len(whole) + turns * (max_new_tokens + 16))
    return min(longest + 1, limit) if limit else longest + 1


def regenerate_vllm(conversations: list[dict[str, Any]], outputs: RegenerateOutputs, verifier: str, *,
                    revision: str | None = None, aux_indices: Sequence[int] | None = None, dtype: str = "bfloat16",
                    generation: GenerationOptions | None = None, options: VllmOptions | None = None,
                    store: StoreOptions | None = None, progress: bool = True) -> ExtractionSummary:
    """Answers, features in `dtype` and (with `outputs.prepared`) the prepared dataset, all from one vLLM engine;
    resumes where a killed run stopped. vLLM's options but the endpoint (an engine of our own here)."""
    from ...data.fingerprint import tokenizer_fingerprint, tokenizer_record
    from ...data.prepared_format import save_prepared
    from ...data.prepared_samples import PreparedDataset
    from ...data.thinking_mode import served_kwargs, thinking_mode
    from ...engines.vllm.vllm_env import VllmExtraction, vllm_python
    from ...verifier.loading import load_tokenizer
    from ..records import FeatureHeader
    from ..write import FeatureSink
    from .vllm_spec import VllmFeatureSpec, default_readers

    gen_options, options = generation or GenerationOptions(), options or VllmOptions()
    vllm_python()  # vLLM missing: one line, before anything is written
    output, features_out = Path(outputs.conversations), Path(outputs.features)
    tokenizer = load_tokenizer(verifier, revision=revision)
    fingerprint = tokenizer_fingerprint(tokenizer)
    spec = VllmFeatureSpec(verifier, fingerprint, aux_indices, dtype, verifier, revision, options.dtype)
    ids = [str(c["id"]) for c in conversations]
    if len(set(ids)) != len(ids):
        dup = next(i for k, i in enumerate(ids) if i in ids[:k])
        raise ValueError(f"conversation id {dup!r} appears more than once; ids must be unique")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.touch()
    answered = completed_ids(output) & set(ids)
    todo = [c for c in conversations if str(c["id"]) not in answered]
    max_model_len = options.max_model_len
    if max_model_len is None:
        max_model_len = default_max_model_len(conversations, tokenizer, gen_options.max_new_tokens,
                                              gen_options.max_turns, spec.max_positions)
    eos = eos_ids(spec.path, tokenizer)
    gen = {"max_tokens": gen_options.max_new_tokens, "temperature": gen_options.temperature,
           "top_p": gen_options.top_p, "stop_token_ids": eos, "chunk": GENERATE_CHUNK}
    request = dict(spec.request(max_model_len, options.batch_size, options.max_pending, dict(options.engine)),
                   generate=gen, seed=gen_options.seed)
    readers = default_readers() if options.readers is None else max(1, int(options.readers))
    header = cast(FeatureHeader, {**spec.header, **tokenizer_record(tokenizer),  # + the class that tokenized the data
                                  "chat_template_kwargs": served_kwargs(None, thinking_mode(tokenizer))})  # its mode
    sink = FeatureSink(features_out, header, store=dataclasses.replace(store or StoreOptions(), writers=readers))
    route: dict[str, Any] = {"engine": "vllm", "input": len(ids), "already_answered": len(answered),
                             "vllm_dtype": spec.vllm_dtype, "max_model_len": max_model_len}
    scratch = tempfile.TemporaryDirectory(prefix="eagle3_regen_prepared_") if outputs.prepared is None else None
    prepared_dir = Path(outputs.prepared) if outputs.prepared is not None else \
        Path(cast(Any, scratch).name) / "prepared"
    resumed_past = 0

    def phase_two() -> tuple[PreparedDataset, list[int]]:
        nonlocal resumed_past
        ds, meta = prepare_answers(output, set(ids), tokenizer, verifier, gen_options.max_seq_len)
        if len(ds) == 0:
            raise ValueError(f"{output}: 0 samples to extract (prepare refused: {meta['counts']['skipped']})")
        save_prepared(ds, prepared_dir, meta)
        route["prepared"] = meta["counts"]
        opened = PreparedDataset(prepared_dir, "all", tokenizer_fingerprint=fingerprint)  # as `extract` reads it
        lengths = opened.lengths
        submit = [i for i in range(len(opened)) if opened.sample_ids[i] not in sink.done_ids and lengths[i] > 0]
        longest = max((lengths[i] for i in submit), default=0)
        if longest + 1 > max_model_len:
            raise ValueError(f"--max-model-len {max_model_len}: the longest sample has {longest} tokens (+1 generated)")
        resumed_past = len(opened) - len(submit)
        return opened, submit

    with sink:
        prepared: PreparedDataset | None = None
        submit: list[int] = []
        if not todo:  # all answered: vLLM starts only if some sample has no features yet
            prepared, submit = phase_two()
        if todo or submit:
            write = ConversationWriter(output)
            try:
                with VllmExtraction(request, None, threads=options.threads, debug=options.debug,
                                    timeout=options.timeout) as run:
                    if todo:
                        route.update(generate_answers(run, todo, tokenizer, eos, write, verifier, gen_options.seed,
                                                      gen_options.max_turns))
                        prepared, submit = phase_two()
                    assert prepared is not None  # phase two ran, before vLLM started or after the answers
                    lengths = prepared.lengths
                    sink.progress("regenerate vllm", int(sum(lengths[i] for i in submit)), enabled=progress)
                    run.extract((k, prepared[i]["input_ids"].tolist()) for k, i in enumerate(submit))
                    for feats in spec.features(run.records(), prepared.samples(submit), readers=readers):
                        sink.add(feats)
                    result = run.result or {}
            finally:
                write.close()
            route.update(vllm_version=result.get("vllm_version"), connector=result.get("connector"),
                         vllm_load_seconds=result.get("load_seconds"),
                         vllm_generate_seconds=result.get("generate_seconds"))
    summary = sink.finish([] if prepared is None else prepared.sample_ids, resumed_past=resumed_past, route=route)
    if scratch is not None:
        scratch.cleanup()
    return summary


def generate_plain(verifier: str, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0, vllm_dtype: str = "auto", max_model_len: int = 2048,
                   threads: int = 1,
                   timeout: float | None = None) -> tuple[list[tuple[list[int], str]], dict[str, Any]]:
    """vLLM's plain generation (no speculative method, no connector) of token-id prompts, through the same runner
    and rounds: the reference the tests compare the answers with, and the bench's baseline. Returns
    ([(output ids, finish reason)], the runner's result)."""
    from ...engines.vllm.vllm_env import VllmExtraction
    from ...verifier.loading import load_tokenizer, resolve_verifier
    from .vllm_spec import checkpoint_dtype

    path = resolve_verifier(str(verifier))
    gen = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
           "stop_token_ids": eos_ids(path, load_tokenizer(path)), "chunk": GENERATE_CHUNK}
    request = {"verifier": path, "dtype": checkpoint_dtype(path) if vllm_dtype == "auto" else vllm_dtype,
               "max_model_len": max_model_len, "layer_ids": [], "extract": False, "generate": gen, "seed": seed}
    with VllmExtraction(request, None, threads=threads, timeout=timeout) as run:
        answers = run.generate([(k, ids, turn_seed(seed, str(k), 0)) for k, ids in enumerate(prompts)])
        run.extract([])
        list(run.records())
        result = run.result or {}
    return [(list(answers[k]["output_ids"]), str(answers[k]["finish_reason"])) for k in range(len(prompts))], result


# ------------------------------------------------------------ the route (`regenerate --engine vllm`)

@dataclasses.dataclass(frozen=True)
class VllmGenerationOptions(VllmOptions):
    """`regenerate --engine vllm`'s options: vLLM's record (VllmOptions) read with regenerate's flags and refusals,
    and whether a progress bar shows. Its --endpoint is an answering server, not a vLLM that captures states: an
    engine of our own here."""

    progress: bool = True

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        title = "--engine vllm (answers and features from vLLM, one engine load; `make vllm`)"
        group = parser.add_argument_group(title)
        add_run_arguments(group, "samples")
        group.add_argument("--no-progress", action="store_true")
        add_engine_arguments(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VllmGenerationOptions:
        """Checked: a verifier vLLM loads, one process, no placement, no thinking-mode kwargs yet; then vLLM's own
        checks (VllmOptions.from_args)."""
        if not args.verifier:
            raise ValueError("regenerate --engine vllm needs --verifier (the checkpoint vLLM loads)")
        if args.num_workers != 1:
            raise ValueError("regenerate --engine vllm: --num-workers is for the in-process engine; vLLM batches "
                             "itself (--tensor-parallel-size for more devices)")
        if args.device:
            raise ValueError("regenerate --engine vllm places the verifier itself: drop --device")
        if args.chat_template_kwargs:
            raise ValueError("regenerate --engine vllm does not take --chat-template-kwargs yet (its prompts render "
                             "with the template's default mode): use the in-process route, or regenerate against a "
                             "server (--endpoint) and then prepare and extract with the same --chat-template-kwargs")
        options = cast(VllmGenerationOptions, super().from_args(args))  # a record of this class (cls)
        return dataclasses.replace(options, endpoint=None, storage=None, progress=not args.no_progress)


def run_route(job: RegenerateJob, options: VllmGenerationOptions) -> int:
    """`regenerate --engine vllm --features-out F`; prints the summary as one JSON line on stdout."""
    assert job.verifier is not None, "VllmGenerationOptions refused a run without --verifier"
    outputs = job.feature_outputs()
    summary = regenerate_vllm(list(job.conversations()), outputs, job.verifier, revision=job.revision,
                              aux_indices=None if job.aux_indices is None else list(job.aux_indices),
                              dtype=job.features_dtype, generation=job.generation, options=options,
                              store=StoreOptions(job.samples_per_shard), progress=options.progress).as_dict()
    print(json.dumps(summary))
    print(f"regenerate --engine vllm: {summary.get('conversations', 0)} conversations answered, "
          f"{summary['already_answered']} already answered, {summary['written_samples']} samples written "
          f"({summary['total_samples']} in all) -> {outputs.conversations}, {outputs.features}"
          + (f", {outputs.prepared}" if outputs.prepared else ""), file=sys.stderr)
    return 0
