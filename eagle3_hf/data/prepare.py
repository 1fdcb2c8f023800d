"""Render conversations with the verifier's own chat template and mark the tokens that carry loss.

Only what the verifier itself would generate carries loss: each assistant message's content (its
reasoning and tool calls too, when kept) and its end-of-turn token, never the system/user text or the
assistant header. The span of assistant turn i is found without parsing any template: render
`messages[:i]` with the generation prompt (ends right after the header) and `messages[:i+1]` (ends after
the turn); the difference, trailing whitespace removed (ChatML's newline after `<|im_end|>` is never
generated), is the turn; the tokens that start inside it carry loss (token_boundaries.py: by the tokenizer's
offsets, or by encoding where a slow tokenizer has none). A template for which the prefixes don't line up (e.g.
one that drops reasoning from earlier turns) is refused by sample name.

Reasoning (`reasoning_content` / `reasoning`, or an inline `<think>…</think>`) is trained by default, each turn as
the model emitted it, also where the template blanks it (Kimi-K2.5, Qwen3, DeepSeek-R1): reasoning.py says how;
`--reasoning drop` trains on the answers only.

A verifier without a template (a base model), or one whose template should not be used, gets one with
`--chat-template FILE|NAME`; its sha256 is recorded like any template's. `--text` prepares plain text
instead (`{"prompt", "completion"}` or `{"text"}` rows): loss on the completion, the prompt as context.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from array import array
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ..constants import PREPARE_META
from ..errors import UsageError, json_object
from .chat_render import (  # noqa: F401 (also imported from here)
    NoLossTokens,
    apply_policies,
    assistant_spans,
    chat_template_source,
    turn_end,
)
from .prepared_format import save_prepared, skipped_text
from .token_boundaries import BoundaryInsideToken, span_mask

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedTokenizerBase

FORMAT = "eagle3_hf.prepare/1"
_BATCH_ROWS = 1024


# templates for verifiers that ship none, by name (`--chat-template chatml`)
BUILTIN_TEMPLATES = {
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
               "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
               "{% endif %}"),
}


def resolve_chat_template(tokenizer: PreTrainedTokenizerBase, spec: str) -> str:
    """The template text `spec` names: a file (Jinja text, or JSON with a `chat_template` key as in
    tokenizer_config.json), one of the tokenizer's named templates (e.g. `tool_use`), or a built-in one."""
    path = Path(spec)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            try:
                text = json.loads(text)["chat_template"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path}: a .json chat template file needs a 'chat_template' key") from None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: empty chat template")
        return text
    named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    if spec in named:
        return named[spec]
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    raise ValueError(f"--chat-template {spec}: no such file, nor a template of this tokenizer "
                     f"({', '.join(sorted(named)) or 'it has no named ones'}) or built in "
                     f"({', '.join(BUILTIN_TEMPLATES)})")


def use_chat_template(tokenizer: PreTrainedTokenizerBase, spec: str | None) -> PreTrainedTokenizerBase:
    """Install the template `spec` names on `tokenizer` (no-op for None); returns the tokenizer."""
    if spec:
        tokenizer.chat_template = resolve_chat_template(tokenizer, spec)
    return tokenizer


def render_samples(messages: list[dict], tokenizer: PreTrainedTokenizerBase, *, tools: list | None = None,
                   last_turn_only: bool = False, reasoning: str = "train", tool_calls: str = "keep",
                   template_kwargs: dict | None = None, sample_id: str = "sample",
                   use_offsets: bool | None = None, notes: dict | None = None,
                   ) -> list[tuple[str, list[int], list[int], int]]:
    """(sample id, input_ids, loss_mask, turns trained with their reasoning) of one conversation: one sample, or
    one per turn where the template blanks reasoning that is trained (reasoning.py). Tokenized exactly as
    `apply_chat_template` would; the mask by token offsets or, for a tokenizer without them, by encoding
    (token_boundaries.py). `notes["reasoning_unshown"]` counts the turns whose reasoning the thinking mode does
    not emit (thinking off), so not trained."""
    from .reasoning import policy, render_reasoning, thinking_template

    chosen = policy(reasoning)
    rendered = render_reasoning(messages, tokenizer, sample_id=sample_id, tools=tools, last_turn_only=last_turn_only,
                                tool_calls=tool_calls, template_kwargs=template_kwargs) if chosen == "train" else None
    if rendered is None:  # no reasoning to train (or drop / inline chosen): rendered as it always was
        source = chat_template_source(tokenizer, tools, template_kwargs)
        if chosen == "inline" and thinking_template(source) and any(
                m["role"] == "assistant" and m.get("reasoning_content") for m in messages):
            raise ValueError(f"sample {sample_id}: --reasoning inline writes reasoning into the answer's text, for "
                             "templates without thinking syntax; this chat template renders reasoning itself: use "
                             "--reasoning train")
        renders_reasoning = chosen != "inline" and "reasoning_content" in source
        messages = apply_policies(messages, "drop" if chosen == "drop" else "keep", tool_calls, renders_reasoning)
        text, spans = assistant_spans(messages, tokenizer, tools=tools, last_turn_only=last_turn_only,
                                      template_kwargs=template_kwargs, sample_id=sample_id)
        return [(sample_id, *span_mask(tokenizer, text, spans, sample_id, use_offsets), 0)]
    if notes is not None:
        notes["reasoning_unshown"] += sum(r.unshown_turns for r in rendered)
    return [(r.sample_id, *span_mask(tokenizer, r.text, r.spans, r.sample_id, use_offsets), r.reasoning_turns)
            for r in rendered]


def render_with_mask(messages: list[dict], tokenizer: PreTrainedTokenizerBase, *, tools: list | None = None,
                     last_turn_only: bool = False,
                     reasoning: str = "train", tool_calls: str = "keep", template_kwargs: dict | None = None,
                     sample_id: str = "sample", use_offsets: bool | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation that makes one sample (`render_samples`)."""
    samples = render_samples(messages, tokenizer, tools=tools, last_turn_only=last_turn_only, reasoning=reasoning,
                             tool_calls=tool_calls, template_kwargs=template_kwargs, sample_id=sample_id,
                             use_offsets=use_offsets)
    if len(samples) != 1:
        raise ValueError(f"sample {sample_id}: the template drops its earlier turns' reasoning: it makes "
                         f"{len(samples)} samples, one per turn (render_samples)")
    return samples[0][1], samples[0][2]


def render_completion(prompt: str, completion: str, tokenizer: PreTrainedTokenizerBase,
                      sample_id: str = "sample", use_offsets: bool | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of plain text: the tokenizer's own special tokens (BOS) as it adds them,
    loss on the tokens that start inside the completion (a token straddling the boundary is context)."""
    if not completion:
        raise NoLossTokens("empty completion")
    text = prompt + completion
    core, core_mask = span_mask(tokenizer, text, [(len(prompt), len(text))], sample_id, use_offsets)
    enc = tokenizer(text, return_special_tokens_mask=True)  # the ids written: with BOS (and EOS) as it adds them
    ids, special = list(enc["input_ids"]), enc["special_tokens_mask"]
    at = next((j for j in range(len(ids) - len(core) + 1) if ids[j:j + len(core)] == core), None)
    if at is None:
        raise ValueError(f"sample {sample_id}: the tokenizer's special tokens change the text's other ids")
    mask = [0] * len(ids)
    mask[at:at + len(core)] = core_mask
    return ids, [m & (1 - s) for m, s in zip(mask, special)]  # a special token in the text is never loss


def new_stats() -> dict:
    return {"input": 0, "samples": 0, "tokens": 0, "loss_tokens": 0, "truncated": 0, "reasoning_turns": 0,
            "reasoning_unshown": 0, "skipped": Counter(), "skipped_ids": defaultdict(list)}


def prepare_conversations(conversations: Iterable[dict], tokenizer: PreTrainedTokenizerBase, *,
                          max_seq_len: int | None = None,
                          overlong: str = "truncate", last_turn_only: bool = False, reasoning: str = "train",
                          tool_calls: str = "keep", template_kwargs: dict | None = None, split_turns: bool = False,
                          stats: dict | None = None, progress: bool = False, text: bool = False,
                          source: str | None = None) -> datasets.Dataset:
    """Conversations (`{"id", "messages"}`) -> Dataset(id, input_ids int32, loss_mask int8).

    `text=True`: the rows are plain text (`{"id", "prompt", "completion"}`), rendered by `render_completion`.
    Samples without loss tokens are skipped and counted in `stats["skipped"]`; over-long ones are
    truncated, skipped or refused (`overlong`) and counted. `split_turns` makes one sample per assistant
    turn (id `ID#turnK`, history as the template renders it), for templates that rewrite history; so does
    `reasoning="train"` (the default) for a conversation whose reasoning the template drops from history
    (reasoning.py). `stats["reasoning_turns"]` counts the turns trained with their reasoning,
    `stats["reasoning_unshown"]` those whose reasoning the thinking mode does not emit (thinking off). `source` (the
    input's name) heads a sample's refusal, so the line names file and sample.
    """
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable
    from tqdm.auto import tqdm

    if overlong not in ("truncate", "skip", "error"):
        raise ValueError(f"overlong must be truncate|skip|error, got {overlong!r}")
    stats = stats if stats is not None else new_stats()
    features = datasets.Features({"id": datasets.Value("string"),
                                  "input_ids": datasets.List(datasets.Value("int32")),
                                  "loss_mask": datasets.List(datasets.Value("int8"))})
    schema = features.arrow_schema
    batches: list = []
    ids: list[str] = []
    offsets, flat_ids, flat_mask = array("i", [0]), array("i"), array("b")

    def flush() -> None:
        if ids:
            batches.append(pa.record_batch([
                pa.array(ids, pa.string()),
                pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat_ids, pa.int32())),
                pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat_mask, pa.int8())),
            ], schema=schema))
            ids.clear()
            del offsets[1:], flat_ids[:], flat_mask[:]

    seen: set[str] = set()

    def skip(sid: str, reason: str) -> None:
        stats["skipped"][reason] += 1
        stats.setdefault("skipped_ids", defaultdict(list))[reason].append(sid)  # ids only: never text or tokens

    def add_sample(sid: str, messages: list[dict] | dict, tools: list | None) -> None:
        if sid in seen:
            raise ValueError(f"sample {sid}: id appears more than once; ids must be unique")
        seen.add(sid)
        try:
            if text:  # the row itself
                row = cast(dict, messages)
                samples = [(sid, *render_completion(row["prompt"], row["completion"], tokenizer, sid), 0)]
            else:  # its messages
                samples = render_samples(
                    cast(list, messages), tokenizer, tools=tools, last_turn_only=last_turn_only or split_turns,
                    reasoning=reasoning, tool_calls=tool_calls, template_kwargs=template_kwargs, sample_id=sid,
                    notes=stats)
        except NoLossTokens as e:
            skip(sid, str(e))
            return
        except BoundaryInsideToken:  # rare: a slow tokenizer and a token across a loss edge it cannot place
            skip(sid, "a loss boundary inside a token the tokenizer gives no offsets for")
            return
        except ValueError as e:  # a refused sample: named with its input
            if source is None:
                raise
            raise ValueError(f"{source}: {e}") from None
        for unit, input_ids, loss_mask, thought_turns in samples:
            if unit != sid:
                if unit in seen:
                    raise ValueError(f"sample {unit}: id appears more than once; ids must be unique")
                seen.add(unit)
            add_one(unit, input_ids, loss_mask, thought_turns)

    def add_one(sid: str, input_ids: list[int], loss_mask: list[int], thought_turns: int) -> None:
        if max_seq_len is not None and len(input_ids) > max_seq_len:
            if overlong == "error":
                raise ValueError(f"sample {sid}: {len(input_ids)} tokens > max_seq_len {max_seq_len} "
                                 f"(use --overlong truncate or skip)")
            if overlong == "skip":
                skip(sid, f"longer than max_seq_len {max_seq_len}")
                return
            input_ids, loss_mask = input_ids[:max_seq_len], loss_mask[:max_seq_len]
            stats["truncated"] += 1
        n_loss = sum(loss_mask)
        if n_loss == 0:
            skip(sid, "no loss tokens" + (" within max_seq_len" if max_seq_len else ""))
            return
        ids.append(sid)
        flat_ids.extend(input_ids)
        flat_mask.extend(loss_mask)
        offsets.append(len(flat_ids))
        stats["samples"] += 1
        stats["tokens"] += len(input_ids)
        stats["loss_tokens"] += n_loss
        stats["reasoning_turns"] += thought_turns
        if len(ids) >= _BATCH_ROWS:
            flush()

    bar = tqdm(conversations, desc="prepare", unit="conv", disable=not progress)
    for conv in bar:
        stats["input"] += 1
        units = [(conv["id"], conv if text else conv["messages"])]
        if split_turns and not text:
            turns = [i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant"]
            units = [(f"{conv['id']}#turn{k}", conv["messages"][: i + 1]) for k, i in enumerate(turns)] or units
        for sid, messages in units:
            add_sample(sid, messages, conv.get("tools"))
        bar.set_postfix(tokens=stats["tokens"], refresh=False)
    flush()
    table = pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()
    return datasets.Dataset(InMemoryTable(table), info=datasets.DatasetInfo(features=features))


def build_meta(tokenizer: PreTrainedTokenizerBase, tokenizer_name: str, stats: dict, options: dict) -> dict:
    from eagle3_hf.data.fingerprint import tokenizer_fingerprint, tokenizer_record
    from eagle3_hf.data.thinking_mode import served_kwargs, thinking_mode

    counts = {k: v for k, v in stats.items() if k != "skipped_ids"}
    counts["skipped"] = dict(stats["skipped"])
    template_sha = None if options.get("text") else hashlib.sha256(
        chat_template_source(tokenizer, None, options.get("template_kwargs")).encode()).hexdigest()
    mode = None if options.get("text") else thinking_mode(tokenizer, options.get("template_kwargs"))
    return {
        "format": FORMAT,
        "tokenizer": tokenizer_name,
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        **tokenizer_record(tokenizer),  # its class and --trust-remote-code: later stages must load the same class
        "tokenizer_vocab_size": len(tokenizer),
        "chat_template_sha256": template_sha,  # None for plain text
        # what a server must render with to serve the drafter as trained (thinking_mode.py): carried to its config
        "chat_template_kwargs": None if mode is None else served_kwargs(options.get("template_kwargs"), mode),
        "thinking": None if mode is None or mode.variable is None else
        {"variable": mode.variable, "value": mode.value, "given": mode.given},
        "options": options,
        "counts": counts,
        "skipped_ids": {reason: list(ids) for reason, ids in stats.get("skipped_ids", {}).items()},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", default="smollm2-135m-instruct", help="verifier name, Hub id or path")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--input", required=True,
                        help="JSONL/JSON file, saved dataset dir, Hub dataset id, or 'default'")
    parser.add_argument("--split", default="train", help="split when --input is a dataset")
    parser.add_argument("--output", required=True, help="output directory (datasets save_to_disk)")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N conversations")
    parser.add_argument("--max-seq-len", type=int, default=None)
    parser.add_argument("--overlong", choices=("truncate", "skip", "error"), default="truncate")
    parser.add_argument("--last-turn-only", action="store_true", help="loss on the last assistant turn only")
    parser.add_argument("--split-turns", action="store_true",
                        help="one sample per assistant turn (for templates that rewrite earlier turns, e.g. drop "
                             "their reasoning)")
    parser.add_argument("--reasoning", choices=("train", "drop", "inline"), default="train",
                        type=lambda s: "train" if s == "keep" else s,
                        help="train: reasoning carries loss, each turn as the model emitted it in the thinking mode "
                             "rendered (none with thinking off), also where the chat template blanks it (one sample "
                             "per turn then); refused by sample where the template shows no <think> block to put it "
                             "in, or has no thinking syntax at all. drop: train on the answers only. inline: a "
                             "template without thinking syntax gets the reasoning as <think>...</think> text before "
                             "the answer")
    parser.add_argument("--tool-calls", choices=("keep", "drop"), default="keep")
    parser.add_argument("--chat-template-kwargs", "--template-kwargs", dest="template_kwargs", type=json_object,
                        default=None, metavar="JSON",
                        help='JSON passed to the chat template, as a server gets it (chat_template_kwargs), e.g. '
                             '\'{"thinking": false}\' (Kimi-K2.x) or \'{"enable_thinking": false}\' (Qwen3): the '
                             "thinking mode the drafter is trained for and must be served in; recorded with the data. "
                             "Not given: the template's default")
    parser.add_argument("--chat-template", default=None,
                        help="chat template to use instead of (or, for a base model, in the absence of) the "
                             "tokenizer's: a Jinja file, a .json with a chat_template key, one of the tokenizer's "
                             f"named templates, or built in ({', '.join(BUILTIN_TEMPLATES)})")
    parser.add_argument("--text", action="store_true",
                        help='plain text for base verifiers: rows {"prompt", "completion"} (loss on the completion) '
                             'or {"text"} (loss on all of it); no chat template')


def run(args: argparse.Namespace) -> int:
    from eagle3_hf.data.conversations import load_conversations
    from eagle3_hf.verifier.loading import load_tokenizer

    if args.chat_template and (args.template_kwargs or {}).get("chat_template"):
        raise UsageError("pass the template either as --chat-template or in --template-kwargs, not both")
    if args.text and args.chat_template:
        raise UsageError("--text prepares plain text without a chat template; drop --chat-template")
    tokenizer = use_chat_template(load_tokenizer(args.tokenizer, revision=args.revision), args.chat_template)
    conversations = load_conversations(args.input, limit=args.limit, split=args.split, text=args.text)
    knobs = ("max_seq_len", "overlong", "last_turn_only", "split_turns", "reasoning", "tool_calls", "template_kwargs",
             "text")
    options = {k: getattr(args, k) for k in knobs}
    if not args.text:
        from .thinking_mode import thinking_mode

        line = thinking_mode(tokenizer, args.template_kwargs).default_line()
        if line:
            print(f"prepare: {line}", file=sys.stderr)
    stats = new_stats()
    ds = prepare_conversations(conversations, tokenizer, stats=stats, progress=True, source=args.input, **options)
    meta = build_meta(tokenizer, args.tokenizer, stats, dict(options, input=args.input, limit=args.limit,
                                                             chat_template=args.chat_template))
    c = meta["counts"]
    if c["samples"] == 0:
        skipped = f"; skipped: {skipped_text(c['skipped'])}" if c["skipped"] else ""
        raise ValueError(f"prepare: 0 samples from {c['input']} conversations in {args.input}{skipped}; "
                         f"nothing written to {args.output}")
    out = save_prepared(ds, args.output, meta)
    print(f"prepare: {c['samples']} samples from {c['input']} conversations, {c['tokens']} tokens, "
          f"{c['loss_tokens']} loss tokens -> {out}", file=sys.stderr)
    if c["truncated"]:
        print(f"prepare: truncated {c['truncated']} samples to {args.max_seq_len} tokens", file=sys.stderr)
    for reason, n in c["skipped"].items():
        print(f"prepare: skipped {n} samples: {reason} (ids in {Path(out) / PREPARE_META})", file=sys.stderr)
    if c.get("reasoning_turns"):
        print(f"prepare: {c['reasoning_turns']} assistant turns trained with their reasoning (--reasoning "
              f"{args.reasoning})", file=sys.stderr)
    if c.get("reasoning_unshown"):
        print(f"prepare: {c['reasoning_unshown']} assistant turns' reasoning not trained: thinking is off "
              f"(chat-template kwargs {json.dumps(meta['chat_template_kwargs'])}), the model emits none in this mode",
              file=sys.stderr)
    if c["skipped"].get("no assistant turn"):
        print("prepare: prompts without an answer need `eagle3-hf regenerate` first", file=sys.stderr)
    return 0
