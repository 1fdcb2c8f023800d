"""Each side at its best: our drafter and speculators 0.9.0's, each trained at the same grid of learning rates on
the same batches, each side's best chosen on the development set, best against best on the test set.

For every learning rate in `--lrs`, `experiments/quality_vs_speculators.py` trains ours at that lr (our
optimizer and schedule) and speculators at that lr (its optimizer, Muon + AdamW, and its schedule) on the same
dumped batches, and decodes both on the development set (`--select`, prompts no training pool draws). Each
side's best lr is the one with the highest real τ there (validation simulated τ breaks a tie). Then the two
bests, and each side's default lr (ours 2e-3, speculators 1e-3), are decoded on the test set (`--test`, all 80
MT-bench questions by default). Both sides get the same grid: the same tuning effort.

    .venv/bin/python -m experiments.speculators_lr_sweep --features demo_out/small/features \\
        --max-train-tokens 25600 --epochs 3 --lrs 1e-3 2e-3 4e-3 --output-dir runs/spec_sweep

Finished runs are reused on a rerun. Writes `sweep.json` under --output-dir and, with --table, a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.train_step import REPO
from experiments.quality_vs_speculators import DEFAULT_LR
from experiments.runs import evaluate_drafter_cli, parse_eval_sets, run_logged

SIDES = tuple(DEFAULT_LR)  # each side's checkpoint folder under lr-X/ is its name


def run_lr(args: argparse.Namespace, lr: float, env: dict) -> dict:
    """Train both sides at `lr` and decode both on the development set; quality_vs_speculators' results."""
    out = Path(args.output_dir) / f"lr-{lr:g}"
    cmd = [sys.executable, "-m", "experiments.quality_vs_speculators", "--features", args.data_dir,
           "--output-dir", str(out), "--epochs", str(args.epochs), "--lr", f"{lr:g}", "--spec-lr", f"{lr:g}",
           "--max-train-tokens", str(args.max_train_tokens), "--eval", *args.select,
           "--eval-tokens", str(args.select_tokens), "--verifier", args.verifier, "--reuse"]
    print(f"lr {lr:g}: {shlex.join(cmd[1:])}", flush=True)
    run_logged(cmd, Path(args.output_dir) / f"lr-{lr:g}.log", env, REPO)
    return json.loads((out / "results.json").read_text(encoding="utf-8"))


def dev_score(row: dict) -> tuple[float, float]:
    """Real τ on the last development set, then validation simulated τ."""
    last = list(row["eval"].values())[-1]
    return last["acceptance_length"], row["validation"]["simulated_acceptance_length"]


def pick_lrs(by_lr: dict[float, dict]) -> dict[str, dict[str, float]]:
    """Per side, the lr with the best development score (the first of the grid on a tie) and its default lr."""
    picks = {}
    for side in SIDES:
        best = max(by_lr, key=lambda lr: dev_score(by_lr[lr]["results"][side]))
        picks[side] = {"best": best, "default": DEFAULT_LR[side]}
    return picks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", dest="data_dir", required=True, help="features directory with vocab.safetensors")
    p.add_argument("--output-dir", default="runs/spec_sweep")
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 2e-3, 4e-3])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-train-tokens", type=int, default=25600)
    p.add_argument("--select", nargs="+", default=["dev=40"], metavar="PROMPTS=N", help="development set(s)")
    p.add_argument("--select-tokens", type=int, default=32)
    p.add_argument("--test", default="mt-bench=0", metavar="PROMPTS=N", help="test set (0: all prompts)")
    p.add_argument("--test-tokens", type=int, default=32)
    p.add_argument("--parallel", type=int, default=2, help="learning rates at once (one thread each)")
    p.add_argument("--table", default=None)
    args = p.parse_args()
    missing = [f"{lr:g}" for lr in DEFAULT_LR.values() if lr not in args.lrs]
    if missing:
        raise SystemExit(f"--lrs must include each side's default lr; missing {', '.join(missing)}")
    parse_eval_sets(args.select)
    (test_prompts, test_n), = parse_eval_sets([args.test])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        by_lr = dict(zip(args.lrs, pool.map(lambda lr: run_lr(args, lr, env), args.lrs)))

    picks = pick_lrs(by_lr)
    tests = {(side, lr) for side, pick in picks.items() for lr in pick.values()}
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        measured = dict(zip(tests, pool.map(
            lambda t: evaluate_drafter_cli(out / f"lr-{t[1]:g}" / t[0], args.verifier, test_prompts,
                                           test_n, args.test_tokens, out, env), tests)))

    dev_label = list(by_lr[args.lrs[0]]["results"]["ours"]["eval"])[-1]
    lines = [f"Development set ({dev_label}, {args.select_tokens} new tokens; real τ / validation simulated τ) per "
             "learning rate:", "", "| lr | ours | speculators |", "|---|---|---|"]
    for lr in args.lrs:
        cells = []
        for side in SIDES:
            tau, sim = dev_score(by_lr[lr]["results"][side])
            mark = " **best**" if picks[side]["best"] == lr else ""
            cells.append(f"{tau:.3f} / {sim:.3f}{mark}")
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    test_label = f"{test_prompts} ×{measured[('ours', picks['ours']['best'])].get('num_prompts', test_n)}"
    lines += ["", f"Test set ({test_label}, {args.test_tokens} new tokens, k = 3, greedy):", "",
              "| row | ours: lr, real τ, lossless | speculators: lr, real τ, lossless | ours / speculators |",
              "|---|---|---|---|"]
    summary = {}
    for row in ("best", "default"):
        cells, taus = [], []
        for side in SIDES:
            lr = picks[side][row]
            e = measured[(side, lr)]
            taus.append(e["acceptance_length"])
            cells.append(f"{lr:g}, {e['acceptance_length']:.3f}, {e['lossless']}")
        summary[row] = {"ours_lr": picks["ours"][row], "speculators_lr": picks["speculators"][row],
                        "ours_tau": taus[0], "speculators_tau": taus[1], "ratio": taus[0] / taus[1]}
        name = "each side's best lr (chosen on the development set)" if row == "best" else "each side's default lr"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | **{taus[0] / taus[1]:.3f}** |")
    table = "\n".join(lines) + "\n"
    print(table)
    (out / "sweep.json").write_text(json.dumps({
        "args": vars(args), "picks": picks, "summary": summary,
        "development": {f"{lr:g}": {side: by_lr[lr]["results"][side] for side in SIDES} for lr in args.lrs},
        "seconds": {f"{lr:g}": by_lr[lr]["seconds"] for lr in args.lrs},
        "test": {f"{side}@{lr:g}": e for (side, lr), e in measured.items()},
    }, indent=1), encoding="utf-8")
    if args.table:
        Path(args.table).write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()
