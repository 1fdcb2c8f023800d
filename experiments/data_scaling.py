"""How much data does a drafter need? Train the same recipe on nested subsets of one dataset and measure.

Every point trains on N training tokens of the same features (`--max-train-tokens`: whole samples, a seeded
shuffle stratified by prompt source, so each subset contains the smaller ones and keeps the full mix), validates
on the same validation split, and is decoded for real on the development set (`--prompts dev`) and on MT-bench
(the test set; no training pool draws either). Prints and writes a table (with each point's source mix and
mean sample length) and a PNG of simulated τ (validation) and real τ against training tokens. Finished points
are reused on a rerun. `--predict-largest` leaves the largest point out of the fit and sets the fit's
prediction for it against its measurement.

    python -m experiments.data_scaling --features demo_out/small/features --output-dir runs/scaling --parallel 1 \
        --points 0,51200,25600,12800 --eval dev=40 mt-bench=80 --table docs/results/data_scaling.md \
        --plot docs/results/data_scaling.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from experiments.runs import CLI, evaluate_drafter_cli, parse_eval_sets, run_logged

SET_NAMES = {"dev": "the development set (`dev`: prompts no training pool draws)",
             "mt-bench": "MT-bench (the test set, first turn)"}


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


def prediction(rows: list[dict], fit_points: int = 4) -> str:
    """The fit over the points below the largest against the largest point's measured τ (the prediction tested)."""
    fit, last = rows[:-1][-fit_points:], rows[-1]
    if len(fit) < 2:
        return ""
    tokens = [r["tokens"] for r in fit]
    lines = [f"Prediction tested: the fit over the {len(fit)} points below {last['tokens']:,} tokens, extended to "
             f"{last['tokens']:,} tokens, against the measurement there.", "",
             "| τ | fit's prediction | measured |", "|---|---|---|"]
    for key, label in (("sim_tau", "simulated (validation)"), *((f"real_tau:{n}", f"real ({n})")
                                                                for n in last.get("eval_sets", []))):
        a, b = per_doubling(tokens, [r[key] for r in fit])
        lines.append(f"| {label} | {a + b * math.log2(last['tokens']):.3f} | {last[key]:.3f} |")
    return "\n".join(lines)


def subset_make_up(data_dir: str, point: int, validation_fraction: float) -> dict:
    """Source mix and mean length of the training subset a point trains on (what --max-train-tokens selects)."""
    from eagle3_hf.data.subsets import describe
    from eagle3_hf.features.reader import FeatureDataset

    ds = FeatureDataset(data_dir, "train", validation_fraction, verify="none", max_tokens=point or None)
    return describe(ds.sample_ids, ds.lengths)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", dest="data_dir", required=True,
                   help="features (with vocab.safetensors) of the largest dataset")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--points", default="10000,20000,40000,80000,0", help="training tokens; 0 = all")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--train-args", default="--learning-rate 2e-3 --lr-scheduler-type cosine --warmup-steps 0.05 "
                   "--max-seq-len 256 --per-device-train-batch-size 1 --validation-fraction 0.05 --seed 0 "
                   "--eval-strategy epoch --save-strategy epoch --save-total-limit 1 --load-best-model-at-end true "
                   "--logging-steps 20")
    p.add_argument("--eval", nargs="+", default=["dev=40", "mt-bench=80"], metavar="PROMPTS=N",
                   help="prompt sets to decode each point on (`evaluate --prompts`), N prompts each (0: all); the "
                        "last one is the fit's real τ")
    p.add_argument("--predict-largest", action="store_true",
                   help="fit without the largest point and report its predicted against its measured τ")
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--parallel", type=int, default=1, help="points at once (one thread each)")
    p.add_argument("--table", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")
    eval_sets = parse_eval_sets(args.eval)
    vf_parser = argparse.ArgumentParser(add_help=False)
    vf_parser.add_argument("--validation-fraction", type=float, default=0.05)
    validation_fraction = vf_parser.parse_known_args(shlex.split(args.train_args))[0].validation_fraction

    def train_and_evaluate(point: int) -> dict:
        name = f"tokens-{point or 'all'}"
        run_dir = out / name
        if not (run_dir / "eagle3_training.json").is_file():
            run_logged([*CLI, "train", "--verifier", args.verifier, "--features", args.data_dir,
                        "--output-dir", str(run_dir), "--num-train-epochs", str(args.epochs),
                        *shlex.split(args.train_args), *(["--max-train-tokens", str(point)] if point else [])],
                       out / f"{name}.log", env)
        summary = json.loads((run_dir / "eagle3_training.json").read_text())
        row = {"tokens": summary["data"]["num_tokens"], "samples": summary["data"]["num_samples"],
               "sim_tau": summary["metrics"]["simulated_acceptance_length"],
               "acc0": summary["metrics"]["step_accuracy"][0], "lossless": True, "eval_sets": [],
               "make_up": subset_make_up(args.data_dir, point, validation_fraction)}
        for prompts, n in eval_sets:
            evaluation = evaluate_drafter_cli(run_dir, args.verifier, prompts, n, args.eval_tokens, out, env)
            label = f"{prompts} ×{evaluation.get('num_prompts', n)}" if n else prompts
            row["eval_sets"].append(label)
            row[f"real_tau:{label}"] = evaluation["acceptance_length"]
            row["lossless"] = row["lossless"] and evaluation["lossless"]
        row["real_tau"] = row[f"real_tau:{row['eval_sets'][-1]}"]
        print(json.dumps(row), flush=True)
        return row

    points = [int(x) for x in args.points.split(",")]
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        rows = sorted(pool.map(train_and_evaluate, points), key=lambda r: r["tokens"])

    sets = rows[-1]["eval_sets"]
    lines = ["# How much data does a drafter need?", "",
             f"Same recipe ({args.epochs} epochs, `{args.train_args}`) on nested subsets of `{args.data_dir}`: whole "
             "samples, a seeded shuffle stratified by prompt source (`--max-train-tokens`), the same validation "
             f"split. Real τ by speculative decoding, {args.eval_tokens} new tokens per prompt, k = 3, greedy, on "
             + " and ".join(SET_NAMES.get(name, f"`{name}`") + f", {n or 'all'} prompts" for name, n in eval_sets)
             + ".", "",
             "```bash", "python -m experiments.data_scaling " + shlex.join(sys.argv[1:]), "```", "",
             "| training tokens | samples | mean length | step-0 acc (val) | simulated τ (val) | "
             + " | ".join(f"real τ ({s})" for s in sets) + " | lossless |",
             "|---|---|---|---|---|" + "---|" * len(sets) + "---|"]
    lines += [f"| {r['tokens']:,} | {r['samples']} | {r['make_up']['mean_length']:.0f} | {r['acc0']:.3f} | "
              f"{r['sim_tau']:.3f} | " + " | ".join(f"{r[f'real_tau:{s}']:.3f}" for s in sets)
              + f" | {r['lossless']} |" for r in rows]
    names = sorted({n for r in rows for n in r["make_up"]["sources"]})
    lines += ["", "Source mix of each training subset (share of samples):", "",
              "| training tokens | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {r['tokens']:,} | " + " | ".join(f"{100 * r['make_up']['sources'].get(n, 0):.0f} %" for n in names)
              + " |" for r in rows]
    fit_rows = rows[:-1] if args.predict_largest else rows
    lines += ["", extrapolation(fit_rows) + f" (Real τ here: {sets[-1]}.)"]
    if args.predict_largest:
        lines += ["", prediction(rows)]
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
        for marker, s in zip("s^dv", sets):
            ax.plot(tokens, [r[f"real_tau:{s}"] for r in rows], f"{marker}-", label=f"real τ ({s})")
        ax.set_xscale("log")
        ax.set_xlabel("training tokens")
        ax.set_ylabel("acceptance length τ (k = 3)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
