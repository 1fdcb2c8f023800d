"""EAGLE-3 against EAGLE 3.1 on the demo's data: docs/results/eagle31.md.

The demo's recipe (examples/recipes/small_cpu.yaml, two processes) trains each flavour with each seed on the same
features and draft vocabulary; only the flavour flags differ between a seed's runs. Each drafter is then decoded
for real (greedy, lossless) on all 80 MT-bench questions as a chain (k = 3) and as the demo's tree (S 3, K 4, N 4,
SGLang's attention rule), and its validation simulated τ is read from its training record. The spread between two
seeds of one flavour is the yardstick a difference between flavours is read against. Finished stages are reused,
so a killed run resumes:

    .venv/bin/python -m experiments.eagle31 --out runs/eagle31            # data, training, decoding
    .venv/bin/python -m experiments.eagle31 --out runs/eagle31 --table docs/results/eagle31.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.runs import CLI, run_logged
from experiments.tree_attention import decode_all

VERIFIER = "smollm2-135m-instruct"
RECIPE = "examples/recipes/small_cpu.yaml"
FLAVOURS = {"3.0": [], "3.1": ["--norm-before-fc", "true", "--norm-output", "true"]}
DECODES = [{"steps": 3, "topk": 1, "num_draft_tokens": 4, "rule": "chain"},
           {"steps": 3, "topk": 4, "num_draft_tokens": 4, "rule": "sglang"}]
MAX_NEW_TOKENS = 64


def build_data(out: Path, prompts: int) -> Path:
    """The demo's data, as `make demo` makes it: regenerate with features in the same pass, then the vocabulary."""
    data = out / "data"
    if (data / "features" / "vocab.safetensors").is_file():
        return data
    data.mkdir(parents=True, exist_ok=True)
    from eagle3_hf.demo_data.prompts import short_prompts

    rows = "".join(json.dumps(p) + "\n" for p in short_prompts(prompts))
    (data / "prompts.jsonl").write_text(rows, encoding="utf-8")
    run_logged([*CLI, "regenerate", "--input", str(data / "prompts.jsonl"),
                "--output", str(data / "conversations.jsonl"),
                "--verifier", VERIFIER, "--max-new-tokens", "128", "--batch-size", "64", "--num-workers", "2",
                "--features-out", str(data / "features"), "--prepared-out", str(data / "prepared"),
                "--max-seq-len", "1024", "--features-dtype", "bf16"], out / "logs" / "regenerate.log")
    run_logged([*CLI, "vocab", "--data", str(data / "prepared"), "--draft-vocab-size", "4096",
                "--output", str(data / "features" / "vocab.safetensors")], out / "logs" / "vocab.log")
    return data


def train(out: Path, data: Path, flavour: str, seed: int) -> Path:
    """The demo's training command with this flavour's flags and seed."""
    drafter = out / f"eagle{flavour}-seed{seed}"
    if (drafter / "model.safetensors").is_file():
        return drafter
    port = str(29500 + os.getpid() % 1000)
    run_logged(["accelerate", "launch", "--config_file", "accelerate_configs/cpu_2proc.yaml", "--num_processes", "2",
                "--main_process_port", port, "examples/train.py", "--config", RECIPE, "--verifier", VERIFIER,
                "--features", str(data / "features"), "--output-dir", str(drafter), "--seed", str(seed),
                *FLAVOURS[flavour]], out / "logs" / f"{drafter.name}.train.log")
    return drafter


def decode(drafters: list[Path], out: Path) -> None:
    """Every drafter's chain and tree on all 80 questions, one single-thread process per core."""
    jobs = [(d, out / "decode" / d.name) for d in drafters]
    procs = []
    for shard in range(2):
        mine = jobs[shard::2]
        if not mine:
            continue
        args = [sys.executable, "-m", "experiments.eagle31", "--decode-only",
                *[f"{d}={o}" for d, o in mine]]
        procs.append(subprocess.Popen(args, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    if any(p.wait() for p in procs):
        raise SystemExit("a decoding process failed (its output is above)")


def simulated_tau(drafter: Path) -> float:
    """The kept (best) epoch's validation simulated τ from the training record."""
    record = json.loads((drafter / "eagle3_training.json").read_text(encoding="utf-8"))
    return float(record["metrics"]["simulated_acceptance_length"])


def table(out: Path, seeds: list[int]) -> str:
    """Per drafter, then per flavour (mean and spread over seeds) and the difference; a run not finished is "—"."""
    rows, taus = [], {}
    for flavour in FLAVOURS:
        for seed in seeds:
            name = f"eagle{flavour}-seed{seed}"
            runs = out / "decode" / name
            decoded = {r["rule"]: json.loads(path.read_text()) for r in DECODES
                       if (path := runs / f"S3-K{r['topk']}-N4-{r['rule']}.json").is_file()}
            sim = simulated_tau(out / name)
            chain, tree = (decoded[rule]["tau"] if rule in decoded else None for rule in ("chain", "sglang"))
            taus[(flavour, seed)] = (sim, chain, tree)
            hashes = sorted({d["tokens_sha256"] for d in decoded.values()})
            rows.append(f"| {flavour} | {seed} | {sim:.3f} | {_num(chain)} | {_num(tree)} | {', '.join(hashes)} |")
    lines = ["| flavour | seed | simulated τ (validation) | τ chain k=3 (80 questions) "
             "| τ tree S3 K4 N4 (80 questions) | answers' hash (chain, tree) |", "|---|---|---|---|---|---|", *rows, ""]
    lines += ["| | simulated τ | τ chain | τ tree |", "|---|---|---|---|"]
    for flavour in FLAVOURS:
        cells = []
        for i in range(3):
            values = [v for s in seeds if (v := taus[(flavour, s)][i]) is not None]
            spread = (f"spread {max(values) - min(values):.3f}, {len(values)} seeds" if len(values) > 1
                      else "1 seed")
            cells.append(f"{sum(values) / len(values):.3f} ({spread})" if values else "—")
        lines.append(f"| {flavour}: mean over seeds | " + " | ".join(cells) + " |")
    cells = []
    for i in range(3):
        pairs = [(b, a) for s in seeds
                 if (a := taus[("3.0", s)][i]) is not None and (b := taus[("3.1", s)][i]) is not None]
        seeds_used = f"{len(pairs)} seeds" if len(pairs) > 1 else "seed 0"
        cells.append(f"{sum(b - a for b, a in pairs) / len(pairs):+.3f} ({seeds_used})" if pairs else "—")
    lines.append("| 3.1 − 3.0, same seed, mean | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def write_between_markers(page: Path, name: str, text: str) -> None:
    """Replace what lies between `<!-- NAME: begin -->` and `<!-- NAME: end -->` in `page` with `text`."""
    body = page.read_text(encoding="utf-8")
    begin, end = f"<!-- {name}: begin -->\n", f"<!-- {name}: end -->"
    if begin not in body or end not in body:
        raise SystemExit(f"{page}: no {begin.strip()} ... {end} markers")
    head, _, rest = body.partition(begin)
    page.write_text(head + begin + text + end + rest.partition(end)[2], encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/eagle31"))
    parser.add_argument("--prompts", type=int, default=600, help="the demo's training prompts (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--table", type=Path, default=None, help="print the table and write it between markers here")
    parser.add_argument("--decode-only", nargs="+", default=None, help=argparse.SUPPRESS)  # DRAFTER=OUT pairs
    args = parser.parse_args()
    if args.decode_only:
        import torch

        torch.set_num_threads(1)
        for pair in args.decode_only:
            drafter, _, out = pair.partition("=")
            Path(out).mkdir(parents=True, exist_ok=True)
            decode_all(drafter, VERIFIER, DECODES, Path(out), MAX_NEW_TOKENS, None)
        return
    if args.table:
        text = table(args.out, args.seeds)
        print(text)
        write_between_markers(args.table, "eagle31-table", text)
        return
    data = build_data(args.out, args.prompts)
    drafters = [train(args.out, data, flavour, seed) for seed in args.seeds for flavour in FLAVOURS]
    decode(drafters, args.out)


if __name__ == "__main__":
    main()
