"""EAGLE-3 against EAGLE 3.1 as the field trains it, on the demo's data: docs/results/eagle31.md.

Four flavours on the same features, draft vocabulary and recipe (examples/recipes/small_cpu.yaml, two processes),
differing only in the drafter's options:

- `3.0`: no option (this project's default until this comparison: the residual stream un-normed);
- `3.0-nbr`: `norm_before_residual` (the 3.0 drafter speculators trains by default);
- `3.1`: `norm_before_residual`, `norm_before_fc`, `norm_output` (EAGLE 3.1 as speculators trains it);
- `norm_output`: `norm_before_residual` + `norm_output`, to say which 3.1 option does what.

The two main flavours (`3.0-nbr`, `3.1`) get the learning rate from the recipe's grid (1e-3, 2e-3, 4e-3, seed 0)
with the best validation simulated τ; the other two keep the recipe's 2e-3, which was tuned for `3.0`
(docs/results/recipe.md). Every flavour trains with seeds 0 and 1; the seed spread is the yardstick. Each drafter
is decoded for real (greedy, lossless) on all 80 MT-bench questions: the chain k = 3 and the demo's tree (S 3, K 4,
N 4, SGLang's rule) for every drafter, the chain k = 5 for the two main flavours. Jobs run two at a time (a
training is two single-thread processes, a decode one), in the order the verdict needs them; every finished job is
reused, so a killed run resumes:

    .venv/bin/python -m experiments.eagle31 --out runs/eagle31            # data, 12 trainings, 20 decodes
    .venv/bin/python -m experiments.eagle31 --out runs/eagle31 --table docs/results/eagle31.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from experiments.runs import CLI, run_logged
from experiments.tree_attention import decode_all

VERIFIER = "smollm2-135m-instruct"
RECIPE = "examples/recipes/small_cpu.yaml"
RECIPE_LR = 2e-3
LR_GRID = (1e-3, 2e-3, 4e-3)
NBR = ["--norm-before-residual", "true"]
FLAVOURS = {"3.0": [], "3.0-nbr": NBR, "3.1": [*NBR, "--norm-before-fc", "true", "--norm-output", "true"],
            "norm_output": [*NBR, "--norm-output", "true"]}
TUNED = ("3.0-nbr", "3.1")
CHAIN3 = {"steps": 3, "topk": 1, "num_draft_tokens": 4, "rule": "chain"}
TREE = {"steps": 3, "topk": 4, "num_draft_tokens": 4, "rule": "sglang"}
CHAIN5 = {"steps": 5, "topk": 1, "num_draft_tokens": 6, "rule": "chain"}
MAX_NEW_TOKENS = 64
_PORTS = itertools.count(29500 + os.getpid() % 400 * 2)


def decode_name(run: dict) -> str:
    return f"S{run['steps']}-K{run['topk']}-N{run['num_draft_tokens']}-{run['rule']}"


def drafter_name(flavour: str, lr: float, seed: int) -> str:
    """The recipe's lr keeps the old name (`eagle3.0-seed0`), which the long-context section decodes."""
    return f"eagle{flavour}-seed{seed}" if lr == RECIPE_LR else f"eagle{flavour}-lr{lr:g}-seed{seed}"


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


def train(out: Path, data: Path, flavour: str, lr: float, seed: int) -> Path:
    """The demo's training command with this flavour's flags, learning rate and seed (two single-thread processes)."""
    drafter = out / drafter_name(flavour, lr, seed)
    wait_for_running("--output-dir", str(drafter))
    if (drafter / "model.safetensors").is_file():
        return drafter
    port = str(next(_PORTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_logged(["accelerate", "launch", "--config_file", "accelerate_configs/cpu_2proc.yaml", "--num_processes", "2",
                "--main_process_port", port, "examples/train.py", "--config", RECIPE, "--verifier", VERIFIER,
                "--features", str(data / "features"), "--output-dir", str(drafter), "--seed", str(seed),
                "--learning-rate", str(lr), *FLAVOURS[flavour]], out / "logs" / f"{drafter.name}.train.log", env)
    return drafter


def wait_for_running(*needles: str) -> None:
    """A job still running from a scheduler that was stopped (its processes outlive it: a process whose command
    line holds every needle) is waited for, not started a second time."""
    import time

    def running() -> bool:
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if all(n in args for n in needles) and args[:1] != ["pgrep"]:
                return True
        return False

    while running():
        time.sleep(30)


def decode(out: Path, drafter: Path, run: dict) -> Path:
    """One decode of all 80 questions in its own single-thread process."""
    path = out / "decode" / drafter.name / f"{decode_name(run)}.json"
    wait_for_running("--decode-only", str(drafter), json.dumps(run))
    if not path.is_file():
        run_logged([sys.executable, "-m", "experiments.eagle31", "--decode-only", str(drafter), json.dumps(run),
                    str(path.parent)], out / "logs" / f"{drafter.name}.{decode_name(run)}.log",
                   {**os.environ, "OMP_NUM_THREADS": "1"})
    return path


def simulated_tau(drafter: Path) -> float | None:
    """The kept (best) epoch's validation simulated τ from the training record; None before it trained."""
    record = drafter / "eagle3_training.json"
    if not record.is_file():
        return None
    return float(json.loads(record.read_text(encoding="utf-8"))["metrics"]["simulated_acceptance_length"])


def chosen_lr(out: Path, flavour: str) -> float | None:
    """The grid's lr with the best seed-0 validation simulated τ (never a test-set number), among the grid's runs
    that finished (the table says which); None before any did."""
    taus = {lr: t for lr in LR_GRID if (t := simulated_tau(out / drafter_name(flavour, lr, 0))) is not None}
    if not taus:
        return None
    return max(taus, key=lambda lr: (taus[lr], -abs(lr - RECIPE_LR)))


def flavour_lr(out: Path, flavour: str) -> float | None:
    return chosen_lr(out, flavour) if flavour in TUNED else RECIPE_LR


@dataclass
class Job:
    """A training or a decode; `ready` says whether what it needs exists yet."""

    name: str
    work: callable
    ready: callable = field(default=lambda: True)


def jobs(out: Path, data: Path, seeds: list[int]) -> list[Job]:
    """Every job in the order the verdict needs it, so that a run cut short has measured what matters most: the
    three main flavours at the recipe's lr, the field's two at 1e-3, the chain decodes at each flavour's best lr so
    far, the grid's 4e-3, the second seeds, the k = 5 chains, `norm_output` and the trees."""
    def training(flavour: str, seed: int, lr: float | None = RECIPE_LR) -> Job:
        def lr_now() -> float | None:
            return lr if lr is not None else flavour_lr(out, flavour)
        return Job(f"train {flavour} lr={lr or 'chosen'} seed={seed}",
                   lambda: train(out, data, flavour, lr_now(), seed), lambda: lr_now() is not None)

    def decoding(flavour: str, seed: int, run: dict, lr: float | None = RECIPE_LR) -> Job:
        def drafter() -> Path | None:
            at = lr if lr is not None else flavour_lr(out, flavour)
            path = out / drafter_name(flavour, at, seed) if at is not None else None
            return path if path is not None and (path / "model.safetensors").is_file() else None
        return Job(f"decode {flavour} lr={lr or 'chosen'} seed={seed} {decode_name(run)}",
                   lambda: decode(out, drafter(), run), lambda: drafter() is not None)

    first, rest = seeds[0], seeds[1:]
    todo = [training(f, first) for f in (*TUNED, "3.0")]
    todo += [training(f, first, 1e-3) for f in TUNED]
    todo += [decoding("3.0", first, CHAIN3), *(decoding(f, first, CHAIN3, None) for f in TUNED)]
    todo += [training(f, first, 4e-3) for f in TUNED]
    todo += [decoding(f, first, CHAIN3) for f in TUNED]  # the recipe's lr too, where the grid chose another
    todo += [training("3.0", s) for s in rest] + [training(f, s, None) for s in rest for f in TUNED]
    todo += [decoding(f, first, CHAIN5, None) for f in TUNED]
    todo += [decoding("3.0", s, CHAIN3) for s in rest] + [decoding(f, s, CHAIN3, None) for s in rest for f in TUNED]
    todo += [decoding(f, s, CHAIN5, None) for s in rest for f in TUNED]
    todo += [training("norm_output", s) for s in seeds] + [decoding("norm_output", s, CHAIN3) for s in seeds]
    todo += [decoding("3.0", s, TREE) for s in seeds] + [decoding(f, s, TREE, None) for s in seeds for f in TUNED]
    todo += [decoding("norm_output", s, TREE) for s in seeds]
    return todo


def run_jobs(todo: list[Job], slots: int) -> None:
    """At most `slots` jobs at a time, each the first ready one in order; a failure stops new starts."""
    lock, wake, running, failed = threading.Lock(), threading.Condition(), set(), []

    def start(job: Job) -> None:
        try:
            job.work()
            print(f"done: {job.name}", flush=True)
        except BaseException as e:  # noqa: BLE001 - reported and re-raised by the scheduler below
            failed.append((job.name, e))
        with wake:
            running.discard(job.name)
            wake.notify_all()

    pending = list(todo)
    with wake:
        while (pending or running) and not failed:
            with lock:
                ready = [j for j in pending if j.ready()] if len(running) < slots else []
            if ready:
                job = ready[0]
                pending.remove(job)
                running.add(job.name)
                print(f"start: {job.name}", flush=True)
                threading.Thread(target=start, args=(job,), daemon=True).start()
                continue
            if not running:
                raise SystemExit(f"nothing can start: {[j.name for j in pending]}")
            wake.wait()
    if failed:
        raise SystemExit(f"{failed[0][0]}: {failed[0][1]}")


def table(out: Path, seeds: list[int]) -> str:
    """The lr grid, then per drafter, then per flavour and lr (mean and spread over seeds); a run not finished
    is "—". Every flavour at the recipe's lr; a main flavour again at the grid's lr where that differs."""
    lines = ["| flavour | lr 1e-3 | lr 2e-3 | lr 4e-3 | chosen |", "|---|---|---|---|---|"]
    for flavour in TUNED:
        taus = [simulated_tau(out / drafter_name(flavour, lr, 0)) for lr in LR_GRID]
        lines.append(f"| {flavour} | " + " | ".join(_num(t) for t in taus) + f" | {_lr(chosen_lr(out, flavour))} |")
    columns = [("simulated τ (validation)", None), ("τ chain k=3", CHAIN3), ("τ tree S3 K4 N4", TREE),
               ("τ chain k=5", CHAIN5)]
    variants = [(f, RECIPE_LR) for f in FLAVOURS]
    variants += [(f, lr) for f in TUNED if (lr := chosen_lr(out, f)) not in (None, RECIPE_LR)]
    lines += ["", "| flavour | lr | seed | " + " | ".join(c for c, _ in columns) + " | answers' hash |",
              "|---|---|---|" + "---|" * len(columns) + "---|"]
    values: dict[tuple[str, float, int], list[float | None]] = {}
    for flavour, lr in variants:
        for seed in seeds:
            drafter = out / drafter_name(flavour, lr, seed)
            row, hashes = [simulated_tau(drafter)], set()
            for _, run in columns[1:]:
                path = out / "decode" / drafter.name / f"{decode_name(run)}.json"
                result = json.loads(path.read_text()) if path.is_file() else None
                row.append(result["tau"] if result else None)
                hashes |= {result["tokens_sha256"]} if result else set()
            values[(flavour, lr, seed)] = row
            lines.append(f"| {flavour} | {_lr(lr)} | {seed} | " + " | ".join(_num(v) for v in row)
                         + f" | {', '.join(sorted(hashes)) or '—'} |")
    lines += ["", "| flavour, lr: mean over seeds (spread) | " + " | ".join(c for c, _ in columns) + " |",
              "|---|" + "---|" * len(columns)]
    for flavour, lr in variants:
        cells = []
        for i in range(len(columns)):
            got = [v for s in seeds if (v := values[(flavour, lr, s)][i]) is not None]
            spread = f"{max(got) - min(got):.3f}, {len(got)} seeds" if len(got) > 1 else "1 seed"
            cells.append(f"{sum(got) / len(got):.3f} ({spread})" if got else "—")
        lines.append(f"| {flavour}, {_lr(lr)} | " + " | ".join(cells) + " |")
    for a, b in (("3.0-nbr", "3.0"), ("3.1", "3.0-nbr"), ("norm_output", "3.0-nbr"), ("3.1", "3.0")):
        cells = []
        for i in range(len(columns)):
            pairs = [(x, y) for s in seeds if (x := values[(a, RECIPE_LR, s)][i]) is not None
                     and (y := values[(b, RECIPE_LR, s)][i]) is not None]
            cells.append(f"{sum(x - y for x, y in pairs) / len(pairs):+.3f} ({len(pairs)} seed"
                         f"{'s' if len(pairs) > 1 else ''})" if pairs else "—")
        lines.append(f"| {a} − {b}, same seed, {_lr(RECIPE_LR)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _lr(lr: float | None) -> str:
    return "—" if lr is None else f"{lr:g}"


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
    parser.add_argument("--slots", type=int, default=2, help="jobs at a time (default: %(default)s)")
    parser.add_argument("--table", type=Path, default=None, help="print the table and write it between markers here")
    parser.add_argument("--decode-only", nargs=3, default=None, help=argparse.SUPPRESS)  # DRAFTER RUN_JSON OUT
    args = parser.parse_args()
    if args.decode_only:
        drafter, run, out = args.decode_only
        Path(out).mkdir(parents=True, exist_ok=True)
        decode_all(drafter, VERIFIER, [json.loads(run)], Path(out), MAX_NEW_TOKENS, None)
        return
    if args.table:
        text = table(args.out, args.seeds)
        print(text)
        write_between_markers(args.table, "eagle31-table", text)
        return
    data = build_data(args.out, args.prompts)
    run_jobs(jobs(args.out, data, args.seeds), args.slots)


if __name__ == "__main__":
    main()
