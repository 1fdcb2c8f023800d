"""`eagle3-hf evaluate`: a drafter's acceptance length, speedup and lossless check over a prompt set.

The decoding itself lives in eagle3_hf/decoding/; this module is the command around it: prompts (MT-bench or a
JSONL file of turns / messages / prompt) rendered with the verifier's chat template, plain and speculative
decoding of each prompt timed back to back, the summary (τ, per-position acceptance, speedup, lossless) and
the outputs acceptance.csv and eagle3_evaluation.json.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..constants import ACCEPTANCE_FILE, EVALUATION_FILE
from ..decoding import SpeculativeResult, acceptance_stats, compare_to_greedy, greedy_generate, speculative_decode
from ..decoding.core import eos_ids
from ..decoding.tree import config_problem, num_candidates
from ..errors import UsageError
from ..verifier.fit import require_fit
from ..verifier.placement import add_placement_arguments, placement_kwargs


def prompt_turns(row: dict | str) -> list[str] | None:
    """User turns of a prompt given as a string, {"turns": [...]}, {"messages": [...]} or {"prompt": str}."""
    if isinstance(row, str):
        return [row]
    if isinstance(row.get("turns"), list):
        return [str(t) for t in row["turns"]]
    if isinstance(row.get("messages"), list):
        return [m["content"] for m in row["messages"] if m.get("role") == "user"]
    return [row["prompt"]] if isinstance(row.get("prompt"), str) else None


def load_prompts(source: str, limit: int | None = None) -> tuple[list[dict], str]:
    """`mt-bench` (the embedded 80 questions, the test set), `dev` (the development set: 40 prompts no training
    pool draws) or a JSONL file whose rows carry `turns` (user messages), `messages` (OpenAI form; its user turns)
    or `prompt`. -> ([{"id", "turns"}], name for the summary)."""
    if source in ("mt-bench", "mtbench"):
        from ..demo_data.prompts import mtbench_questions

        return mtbench_questions(limit), "mt-bench"
    if source == "dev":  # the development set: choose on it, keep MT-bench for the final numbers
        from ..demo_data.prompts import dev_prompts

        return [{"id": row["id"], "turns": prompt_turns(row)} for row in dev_prompts()][:limit], "dev"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist (or use --prompts mt-bench or dev)")
    from ..data.conversations import iter_jsonl

    rows: list[dict] = []
    for line_no, row in iter_jsonl(path):
        if limit and len(rows) >= limit:
            break
        turns = prompt_turns(row) if isinstance(row, dict) else None
        if not turns:
            raise ValueError(f"{path}:{line_no}: expected a non-empty `turns`, `messages` or `prompt` field")
        rows.append({"id": str(row.get("id", row.get("question_id", line_no))), "turns": turns})
    return rows, str(path)


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The verifier's chat template with the generation prompt, as a server renders it; `template_kwargs`: the
    drafter's thinking mode (`drafter_mode`), as its serve lines set it."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {}))
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def drafter_mode(drafter) -> dict:
    """The chat-template kwargs the drafter was trained in (its config's `verifier_chat_template_kwargs`; {} where
    none were recorded): prompts are rendered in that mode, as the served verifier renders them."""
    return dict(getattr(drafter.config, "verifier_chat_template_kwargs", None) or {})


def check_pair(verifier, drafter, tokenizer=None) -> list[str]:
    """The drafter fit (verifier/fit.py) of this pair: a ValueError when it cannot fit, else its warnings; the
    tokenizer, when given, is compared by class and fingerprint with the one the drafter was trained with."""
    from ..data.fingerprint import check_tokenizer_class, tokenizer_fingerprint

    fingerprint = None
    if tokenizer is not None:  # the class the training data was tokenized by, where the drafter records it
        check_tokenizer_class({"tokenizer_class": getattr(drafter.config, "verifier_tokenizer_class", None)},
                              tokenizer, f"the drafter {getattr(drafter.config, '_name_or_path', '') or ''}".rstrip())
    if tokenizer is not None and getattr(drafter.config, "tokenizer_fingerprint", None):
        fingerprint = tokenizer_fingerprint(tokenizer)
    return require_fit(drafter.config, verifier, fingerprint)


def evaluate_drafter(verifier, drafter, tokenizer, prompts: Sequence[dict | str], k: int = 3,
                     max_new_tokens: int = 64, temperature: float = 0.0, turns: int = 1, seed: int = 0,
                     prompts_name: str = "custom", progress: bool = True, topk: int = 1,
                     num_draft_tokens: int | None = None, tree_attention: str = "sglang") -> dict[str, Any]:
    """Run plain and speculative decoding on each prompt (turns > 1 feeds the answer back) and summarise.

    k is SGLang's --speculative-num-steps S; topk K > 1 drafts a tree of num_draft_tokens N (tree.py), its nodes
    attending as `tree_attention` says ("sglang": as SGLang drafts; "ancestors": each node its true path).

    Both runs of a prompt are timed back to back, in alternating order, after an untimed warm-up, so the
    speedup is a ratio measured in one run. The summary's "per_prompt" holds one row per (prompt, turn).
    """
    from tqdm.auto import tqdm

    check_pair(verifier, drafter)
    greedy = temperature <= 0
    items: list[dict[str, Any]] = [
        {"id": str(p.get("id", i)) if isinstance(p, dict) else str(i), "turns": prompt_turns(p)}
        for i, p in enumerate(prompts)]
    if not items or any(not it["turns"] for it in items):
        raise ValueError("no prompts, or a prompt without a user turn")
    mode = drafter_mode(drafter)
    warm = render_prompt(tokenizer, [{"role": "user", "content": items[0]["turns"][0]}], mode)
    greedy_generate(verifier, warm, 2, temperature=temperature, generator=torch.Generator().manual_seed(seed))
    size = (num_draft_tokens or 1 + num_candidates(k, topk)) if topk > 1 else k + 1

    def speculate(ids, new_tokens, generator) -> SpeculativeResult:  # K = 1: the chain; K > 1: the tree
        return speculative_decode(verifier, drafter, ids, steps=k, topk=topk, num_draft_tokens=size,
                                  max_new_tokens=new_tokens, temperature=temperature, generator=generator,
                                  tree_attention=tree_attention)

    speculate(warm, k + 2, torch.Generator().manual_seed(seed))

    eos = eos_ids(verifier, None)
    rows: list[dict] = []
    accepted, drafted, seconds, produced = [], [], {"base": 0.0, "spec": 0.0}, {"base": 0, "spec": 0}
    bar = tqdm(total=sum(min(turns, len(it["turns"])) for it in items), desc="evaluate", unit="turn",
               disable=not progress)
    for index, item in enumerate(items):
        messages: list[dict] = []
        for turn, text in enumerate(item["turns"][:turns]):
            messages.append({"role": "user", "content": text})
            ids = render_prompt(tokenizer, messages, mode)
            runs: dict[str, Any] = {}  # DecodeResult, SpeculativeResult
            for which in ("base", "spec") if (index + turn) % 2 == 0 else ("spec", "base"):
                gen = torch.Generator().manual_seed(seed + 7919 * index + turn)
                runs[which] = (greedy_generate(verifier, ids, max_new_tokens, temperature=temperature, generator=gen)
                               if which == "base" else
                               speculate(ids, max_new_tokens, gen))
                seconds[which] += runs[which].seconds
                produced[which] += len(runs[which].tokens)
            base, spec = runs["base"], runs["spec"]
            status, where = (compare_to_greedy(spec.tokens, spec.margins, base.tokens, base.margins)
                             if greedy else (None, None))
            stats = acceptance_stats(spec.accepted_per_step, spec.drafted_per_step, k)
            rows.append({
                "id": item["id"], "turn": turn + 1, "prompt_tokens": len(ids), "new_tokens": len(spec.tokens),
                "verifier_forwards": spec.num_verifier_forwards, "tau": stats["acceptance_length"],
                "per_position_acceptance": stats["per_position_acceptance"], "lossless": status,
                "first_divergence": where, "tokens": spec.tokens, "accepted_per_step": spec.accepted_per_step,
                "drafted_per_step": spec.drafted_per_step, "baseline_seconds": base.seconds,
                "speculative_seconds": spec.seconds, "verify_seconds": spec.verify_seconds,
            })
            accepted += spec.accepted_per_step
            drafted += spec.drafted_per_step
            answer = [t for t in spec.tokens if t not in eos]
            messages.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
            bar.update(1)
            bar.set_postfix(tau=f"{(sum(accepted) + len(accepted)) / max(len(accepted), 1):.2f}")
    bar.close()

    stats = acceptance_stats(accepted, drafted, k)
    base_tps = produced["base"] / seconds["base"] if seconds["base"] else None
    spec_tps = produced["spec"] / seconds["spec"] if seconds["spec"] else None
    statuses = [r["lossless"] for r in rows]
    return {
        "engine": "transformers", "k": k, "topk": topk,
        "num_draft_tokens": size, "tree_attention": tree_attention if topk > 1 else None,
        "temperature": temperature, "max_new_tokens": max_new_tokens,
        "prompts": prompts_name, "num_prompts": len(items), "turns": turns, "num_samples": len(rows),
        "acceptance_length": stats["acceptance_length"], "per_position_acceptance": stats["per_position_acceptance"],
        "accepted_histogram": stats["accepted_histogram"], "verifier_forwards": stats["num_steps"],
        "new_tokens": produced["spec"], "speedup": spec_tps / base_tps if base_tps and spec_tps else None,
        # sampling is exact in distribution, not token-identical: tested statistically, not here
        "lossless": (statuses.count("mismatch") == 0) if greedy else None,
        "numerical_ties": statuses.count("tie") if greedy else None,
        "mismatches": statuses.count("mismatch") if greedy else None,
        "tokens_per_second": {"baseline": base_tps, "speculative": spec_tps},
        "seconds": {"baseline": seconds["base"], "speculative": seconds["spec"]},
        "device": str(verifier.device), "per_prompt": rows,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """One line: τ, per-position acceptance, speedup, lossless."""
    def num(x, fmt=".3f"):
        return "-" if x is None else format(x, fmt)

    per_pos = ", ".join(num(a) for a in summary["per_position_acceptance"])
    tps = summary["tokens_per_second"]
    shape = (f"steps={summary['k']}, topk={summary['topk']}, N={summary['num_draft_tokens']}, "
             f"tree attention {summary.get('tree_attention') or 'sglang'}"
             if summary.get("topk", 1) > 1 else f"k={summary['k']}")
    return (f"tau {num(summary['acceptance_length'])} ({shape}, T={summary['temperature']}) | per-position "
            f"acceptance [{per_pos}] | speedup {num(summary['speedup'], '.2f')}x ({num(tps['speculative'], '.1f')} vs "
            f"{num(tps['baseline'], '.1f')} tok/s) | lossless {summary['lossless']} (ties {summary['numerical_ties']}, "
            f"mismatches {summary['mismatches']})")


def write_outputs(out_dir: str | Path, summary: dict[str, Any]) -> tuple[Path, Path]:
    """acceptance.csv (one row per prompt and turn) and eagle3_evaluation.json (the summary, rows left out)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    k = int(summary["k"])
    csv_path = out / ACCEPTANCE_FILE
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "turn", "prompt_tokens", "new_tokens", "verifier_forwards", "tau"]
                        + [f"accept_pos{j}" for j in range(1, k + 1)] + ["lossless"])
        for r in summary["per_prompt"]:
            rates = ["" if a is None else f"{a:.4f}" for a in r["per_position_acceptance"]]
            tau = "" if r["tau"] is None else f"{r['tau']:.4f}"
            lossless = "" if r["lossless"] is None else r["lossless"]
            writer.writerow([r["id"], r["turn"], r["prompt_tokens"], r["new_tokens"], r["verifier_forwards"], tau]
                            + rates + [lossless])
    json_path = out / EVALUATION_FILE
    body = {key: value for key, value in summary.items() if key != "per_prompt"}
    json_path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return csv_path, json_path


# ---------------------------------------------------------------- eagle3-hf evaluate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..verifier.loading import DEFAULT_VERIFIER

    parser.add_argument("--drafter", required=True, help="drafter directory or Hub repo id")
    parser.add_argument("--revision", default=None, help="drafter revision (Hub)")
    parser.add_argument("--verifier", default=DEFAULT_VERIFIER, help="verifier name or path (default: %(default)s)")
    parser.add_argument("--verifier-revision", default=None)
    parser.add_argument("--prompts", default="mt-bench",
                        help="mt-bench (test set), dev (development set) or a JSONL file (turns / messages / prompt)")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts (default: all)")
    parser.add_argument("--chat-template", default=None,
                        help="the template the data was prepared with, when not the tokenizer's (see prepare)")
    parser.add_argument("--turns", type=int, default=1, help="1, or 2 to feed the answer back for MT-bench turn 2")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per verifier forward (chain length; = --steps)")
    parser.add_argument("--steps", type=int, default=None, help="SGLang's --speculative-num-steps (default: --k)")
    parser.add_argument("--topk", type=int, default=1, help="SGLang's --speculative-eagle-topk: 1 chain, > 1 tree")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="SGLang's --speculative-num-draft-tokens N, root included (required with --topk > 1)")
    parser.add_argument("--tree-attention", choices=["sglang", "ancestors"], default="sglang",
                        help="what a drafted tree node attends to: sglang (as SGLang drafts: its slot's earlier "
                        "nodes) or ancestors (its true path, an engine with correct tree attention); default sglang")
    parser.add_argument("--sweep", action="store_true",
                        help="evaluate a grid of (steps, topk, num-draft-tokens), print the recommendation as "
                        "SGLang flags, "
                        "write eagle3_sweep.json")
    parser.add_argument("--sweep-steps", type=int, nargs="+", default=None, help="default: 2 3 5")
    parser.add_argument("--sweep-topk", type=int, nargs="+", default=None, help="default: 1 2 4 8")
    parser.add_argument("--sweep-num-draft-tokens", type=int, nargs="+", default=None, help="default: 4 8 16")
    parser.add_argument("--sweep-repeats", type=int, default=1,
                        help="rounds over the grid, configurations interleaved; more rounds narrow the speed intervals")
    parser.add_argument("--verify-costs", default=None, metavar="FILE",
                        help="a verify-cost table (bench/speculative.py --cycle-costs --write-costs FILE, e.g. "
                        "measured on the GPU that will serve): recommend by the speedup predicted there")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    add_placement_arguments(parser, "0=130GiB,1=130GiB", note=", instead of --device; the drafter sits with the "
                            "verifier's first layers")
    parser.add_argument("--torch-dtype", default=None,
                        help="verifier and drafter dtype (default: bfloat16 on a GPU, float32 on the CPU, where the "
                             "lossless check's ties are fp32 ties)")
    parser.add_argument("--output", required=True, help="directory for acceptance.csv and eagle3_evaluation.json")
    parser.add_argument("--write-to-drafter", action="store_true",
                        help="also copy eagle3_evaluation.json into the drafter directory (the model card reads it)")
    parser.add_argument("--no-progress", action="store_true")


def copy_to_drafter(path: Path, drafter: str) -> None:
    """`--write-to-drafter`: the file beside the drafter's weights, where the model card reads it."""
    if Path(drafter).is_dir():
        shutil.copyfile(path, Path(drafter) / Path(path).name)
    else:
        print(f"WARNING: --write-to-drafter ignored: {drafter} is not a local directory", file=sys.stderr)


def default_dtype(requested: str | None, cpu: bool) -> str:
    """--torch-dtype, or by default bfloat16 on a GPU (a verifier of a node's size has no room for float32) and
    float32 on the CPU (the lossless check's ties are then fp32 ties, docs/contracts.md)."""
    return requested or ("float32" if cpu else "bfloat16")


def place_verifier(args: argparse.Namespace, dtype: str):
    """The verifier loaded where the command says -> (verifier, the device its inputs and the drafter go to):
    --device-map shards it over the devices (accelerate's dispatch, layers where --max-memory allows; the
    decoders bring each captured aux state to the input's device), else it goes whole to --device (cuda if
    available)."""
    from ..verifier.loading import load_verifier
    from ..verifier.memory import require_memory

    if args.device_map and args.device:
        raise UsageError("--device-map places the verifier itself: drop --device")
    kwargs, offload = placement_kwargs(args)
    device = None if kwargs else torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    require_memory(args.verifier, args.verifier_revision, dtype, kwargs.get("device_map"), kwargs.get("max_memory"),
                   None if device is None else str(device), args.offload_folder,
                   "evaluate it with --engine vllm over the GPUs that hold it (--tensor-parallel-size, with "
                   "--skip-transformers), or give it more memory (--device-map auto, --max-memory)")
    if kwargs:
        verifier = load_verifier(args.verifier, revision=args.verifier_revision, dtype=dtype, **kwargs)
        if offload is not None:  # the offloaded weights are read while the verifier lives
            weakref.finalize(verifier, offload.cleanup)
        return verifier, verifier.device  # the first parameter's device, where the decoders put their inputs
    assert device is not None
    verifier = load_verifier(args.verifier, revision=args.verifier_revision, dtype=dtype)
    return verifier.to(device), device  # type: ignore[arg-type]  # transformers' wrapped `to` reads as taking self


def load_for_evaluation(args: argparse.Namespace):
    """(verifier, drafter, tokenizer, prompts, prompts name) from the command's arguments, checked: a drafter
    with a non-finite weight is refused, a mismatched pair is refused or warned about by name."""
    from ..data.prepare import use_chat_template
    from ..errors import NonFiniteError, describe_non_finite, non_finite_names
    from ..model.drafter_kind import checkpoint_drafter_kind
    from ..verifier.loading import load_tokenizer

    if args.k < 1 or args.max_new_tokens < 1:
        raise UsageError("--k and --max-new-tokens must be >= 1")
    prompts, name = load_prompts(args.prompts, args.num_prompts)  # first: a missing prompt set costs no model load
    cpu = args.device == "cpu" or (not args.device and not torch.cuda.is_available())
    dtype = default_dtype(args.torch_dtype, cpu)
    verifier, device = place_verifier(args, dtype)
    tokenizer = use_chat_template(load_tokenizer(args.verifier, revision=args.verifier_revision), args.chat_template)
    kind = checkpoint_drafter_kind(args.drafter, args.revision)  # by config.json's architectures, as vLLM picks
    drafter: Any = kind.model_class().from_pretrained(args.drafter, revision=args.revision, dtype=dtype, device=device)
    bad = non_finite_names(drafter.state_dict())
    if bad:  # τ and "lossless" of a NaN drafter would look fine: it drafts nothing the verifier accepts
        raise NonFiniteError(f"drafter {args.drafter}: {describe_non_finite(bad)}; refusing to evaluate "
                             "it (`eagle3-hf check` lists every finding)")
    for warning in check_pair(verifier, drafter, tokenizer):  # before the embeddings: it names the mismatch
        print(f"WARNING: {warning}", file=sys.stderr)
    drafter.load_verifier_embeddings(verifier)
    return verifier, drafter, tokenizer, prompts, name


def run(args: argparse.Namespace) -> int:
    """One configuration (`--sweep` is sweep.run_cli, dispatched by eagle3_hf/evaluation/command.py)."""
    steps = args.steps if args.steps is not None else args.k
    num_draft_tokens = args.num_draft_tokens if args.num_draft_tokens is not None or args.topk > 1 else steps + 1
    if num_draft_tokens is None or config_problem(steps, args.topk, num_draft_tokens):
        raise UsageError("--num-draft-tokens is required with --topk > 1" if num_draft_tokens is None else
                         f"--steps/--topk/--num-draft-tokens: {config_problem(steps, args.topk, num_draft_tokens)}")
    verifier, drafter, tokenizer, prompts, name = load_for_evaluation(args)
    summary = evaluate_drafter(verifier, drafter, tokenizer, prompts, k=steps, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, turns=args.turns, seed=args.seed, prompts_name=name,
                               progress=not args.no_progress, topk=args.topk, num_draft_tokens=num_draft_tokens,
                               tree_attention=args.tree_attention)
    summary.update(verifier=args.verifier, drafter=args.drafter)
    csv_path, json_path = write_outputs(args.output, summary)
    if args.write_to_drafter:
        copy_to_drafter(json_path, args.drafter)
    print(f"{format_summary(summary)}\nwrote {csv_path} and {json_path}")
    return 1 if summary["lossless"] is False else 0
