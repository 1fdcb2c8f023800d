"""How much data does a drafter need? Train the same recipe on nested subsets of one dataset and measure.

Every point trains on the first N training tokens of the same features (`--max-train-tokens`, whole
samples in manifest order, so each subset contains the smaller ones), validates on the same held-out split,
and is decoded for real on MT-bench prompts (never trained on). Prints and writes a table and a PNG of
simulated τ (validation) and real τ against training tokens. Finished points are reused on a rerun.

    python -m experiments.data_scaling --data-dir demo_out/small/features --output-dir runs/scaling --parallel 2 \
        --points 5000,10000,20000,40000,0 --table docs/data_scaling.md --plot docs/data_scaling.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def sh(cmd: list[str], log: Path, env: dict) -> None:
    with open(log, "w", encoding="utf-8") as f:
        if subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env):
            raise SystemExit(f"failed: {shlex.join(cmd)} (log: {log})")


def per_doubling(tokens: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares fit value = a + b * log2(tokens) -> (a, b): b is the gain per doubling of data."""
    xs = [math.log2(t) for t in tokens]
    mx, my = sum(xs) / len(xs), sum(values) / len(values)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def extrapolation(rows: list[dict], fit_points: int = 4) -> str:
    """What the curve's last points say about more data: gain per doubling and the tokens a τ would need.

    A straight line in log2(tokens) through the largest `fit_points` points; beyond the data it is an
    extrapolation (curves of this kind bend eventually), stated as such.
    """
    fit = rows[-fit_points:]
    if len(fit) < 2:
        return ""
    tokens = [r["tokens"] for r in fit]
    a_real, b_real = per_doubling(tokens, [r["real_tau"] for r in fit])
    _, b_sim = per_doubling(tokens, [r["sim_tau"] for r in fit])
    text = (f"Fit over the largest {len(fit)} points (τ linear in log2 tokens): real τ {b_real:+.3f} and simulated τ "
            f"{b_sim:+.3f} per doubling of data.")
    if b_real > 0:
        need = {goal: (goal - a_real) / b_real for goal in (1.5, 2.0)}  # log2 of the tokens
        said = {goal: f"{2 ** e:,.0f}" if e < 60 else "more than 10^18" for goal, e in need.items()}
        text += (f" If that held, real τ 1.5 would need about {said[1.5]} and real τ 2.0 about {said[2.0]} training "
                 "tokens (an extrapolation, not a measurement).")
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="features (with vocab.safetensors) of the largest dataset")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--points", default="10000,20000,40000,80000,0", help="training tokens; 0 = all")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--train-args", default="--learning-rate 2e-3 --lr-scheduler-type cosine --warmup-steps 0.05 "
                   "--max-seq-len 256 --per-device-train-batch-size 1 --validation-fraction 0.05 --seed 0 "
                   "--eval-strategy epoch --save-strategy epoch --save-total-limit 1 --load-best-model-at-end true "
                   "--logging-steps 20")
    p.add_argument("--eval-prompts", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--parallel", type=int, default=1, help="points at once (one thread each)")
    p.add_argument("--table", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")
    cli = [sys.executable, "-m", "eagle3_hf.cli"]

    def train_and_evaluate(point: int) -> dict:
        name = f"tokens-{point or 'all'}"
        run_dir = out / name
        if not (run_dir / "eagle3_training.json").is_file():
            sh([*cli, "train", "--verifier", args.verifier, "--data-dir", args.data_dir, "--output-dir", str(run_dir),
                "--num-train-epochs", str(args.epochs), *shlex.split(args.train_args),
                *(["--max-train-tokens", str(point)] if point else [])], out / f"{name}.log", env)
        if not (run_dir / "eval" / "eagle3_evaluation.json").is_file():
            sh([*cli, "evaluate", "--drafter", str(run_dir), "--verifier", args.verifier, "--prompts", "mt-bench",
                "--num-prompts", str(args.eval_prompts), "--max-new-tokens", str(args.eval_tokens), "--k", "3",
                "--temperature", "0", "--output", str(run_dir / "eval")], out / f"{name}.eval.log", env)
        summary = json.loads((run_dir / "eagle3_training.json").read_text())
        evaluation = json.loads((run_dir / "eval" / "eagle3_evaluation.json").read_text())
        row = {"tokens": summary["data"]["num_tokens"], "samples": summary["data"]["num_samples"],
               "sim_tau": summary["metrics"]["simulated_acceptance_length"],
               "acc0": summary["metrics"]["step_accuracy"][0],
               "real_tau": evaluation["acceptance_length"], "lossless": evaluation["lossless"]}
        print(json.dumps(row), flush=True)
        return row

    points = [int(x) for x in args.points.split(",")]
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        rows = sorted(pool.map(train_and_evaluate, points), key=lambda r: r["tokens"])

    lines = ["# How much data does a drafter need?", "",
             f"Same recipe ({args.epochs} epochs, `{args.train_args}`) on nested subsets of `{args.data_dir}`; "
             f"real τ on {args.eval_prompts} MT-bench questions × {args.eval_tokens} tokens, k = 3, greedy.", "",
             "```bash", "python " + shlex.join(sys.argv), "```", "",
             "| training tokens | samples | step-0 acc (val) | simulated τ (val) | real τ (MT-bench) | lossless |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['tokens']:,} | {r['samples']} | {r['acc0']:.3f} | {r['sim_tau']:.3f} | {r['real_tau']:.3f} | "
              f"{r['lossless']} |" for r in rows]
    lines += ["", extrapolation(rows)]
    table = "\n".join(lines) + "\n"
    print(table)
    (out / "scaling.json").write_text(json.dumps(rows, indent=2))
    if args.table:
        Path(args.table).write_text(table)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        tokens = [r["tokens"] for r in rows]
        ax.plot(tokens, [r["sim_tau"] for r in rows], "o-", label="simulated τ (validation)")
        ax.plot(tokens, [r["real_tau"] for r in rows], "s-", label="real τ (MT-bench)")
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("acceptance length τ (k = 3)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
