"""Choose the training recipe by measurement: one factor at a time around a baseline, on the same data.

Each configuration is a real `eagle3-hf train` run (fresh process, same seed, same data and split) whose
validation metrics come from its `eagle3_training.json`; the best few by simulated acceptance length are
then decoded for real (`eagle3-hf evaluate` on MT-bench prompts, never trained on). Runs already finished
in --output-dir are reused, so a killed sweep resumes. Writes a Markdown table (--table, e.g. docs/results/recipe.md).

    .venv/bin/python -m experiments.recipe --features demo_out/small/features --prepared-dir demo_out/small/prepared \
        --output-dir runs/recipe --table docs/results/recipe.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# name -> (what it varies, extra `train` arguments). `vocab:N` builds an N-token draft vocabulary first.
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "baseline": ("AdamW, lr 2e-3 cosine, γ 0.8, no noise, draft vocab 4096, random trainable lm_head", []),
    "lr-1e-3": ("learning rate", ["--learning-rate", "1e-3"]),
    "lr-4e-3": ("learning rate", ["--learning-rate", "4e-3"]),
    "sched-constant": ("schedule", ["--lr-scheduler-type", "constant_with_warmup"]),
    "sched-linear": ("schedule", ["--lr-scheduler-type", "linear"]),
    "epochs-x2": ("epochs", ["--num-train-epochs", "{2*epochs}"]),
    "gamma-0.6": ("step weight γ", ["--ttt-step-weight", "0.6"]),
    "gamma-1.0": ("step weight γ", ["--ttt-step-weight", "1.0"]),
    "noise-0.5": ("feature noise (std, absolute; aux states have per-dim std 1.5-15)", ["--feature-noise-std", "0.5"]),
    "noise-2": ("feature noise (std, absolute)", ["--feature-noise-std", "2.0"]),
    "vocab-2048": ("draft vocabulary size", ["vocab:2048"]),
    "vocab-8192": ("draft vocabulary size", ["vocab:8192"]),
    "head-verifier": ("lm_head from the verifier's rows, trainable", ["--init-lm-head", "verifier"]),
    "head-verifier-frozen": ("lm_head from the verifier's rows, frozen",
                             ["--init-lm-head", "verifier", "--freeze-lm-head", "true"]),
    "muon": ("optimizer: Muon on hidden matrices", ["--hidden-optimizer", "muon"]),
    "batch-1": ("rows per step (1 x 1024 tokens: twice the optimizer steps)", ["--per-device-train-batch-size", "1"]),
    "rows-512": ("1 row of 512 tokens per step: 4x the optimizer steps",
                 ["--per-device-train-batch-size", "1", "--max-seq-len", "512"]),
    "rows-256": ("1 row of 256 tokens per step: 8x the optimizer steps (longer samples truncated)",
                 ["--per-device-train-batch-size", "1", "--max-seq-len", "256"]),
    "rows-512-epochs-x2": ("512-token rows and twice the epochs",
                           ["--per-device-train-batch-size", "1", "--max-seq-len", "512", "--num-train-epochs",
                            "{2*epochs}"]),
    "batch-1-muon": ("batch-1 and Muon", ["--per-device-train-batch-size", "1", "--hidden-optimizer", "muon"]),
}


def run(cmd: list[str], log: Path, env: dict) -> tuple[int, float]:
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    return rc, time.time() - t0


def train_args(name: str, args: argparse.Namespace, out: Path, env: dict) -> list[str]:
    extra = []
    for token in CONFIGS[name][1]:
        if token.startswith("vocab:"):
            size = int(token.split(":")[1])
            vocab = out / f"vocab_{size}.safetensors"
            if not vocab.is_file():
                rc, _ = run([sys.executable, "-m", "eagle3_hf.cli", "vocab", "--data", args.prepared_dir,
                             "--draft-vocab-size", str(size), "--output", str(vocab)], out / f"vocab_{size}.log", env)
                if rc:
                    raise SystemExit(f"vocab {size} failed: see {out / f'vocab_{size}.log'}")
            extra += ["--vocab", str(vocab)]
        else:
            extra.append(token.replace("{2*epochs}", str(2 * args.epochs)))
    return extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", dest="data_dir", required=True)
    p.add_argument("--prepared-dir", required=True, help="for the draft-vocabulary variants")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--verifier", default="smollm2-135m-instruct")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--base-args", default="--learning-rate 2e-3 --lr-scheduler-type cosine --warmup-steps 0.05 "
                   "--max-seq-len 1024 --per-device-train-batch-size 2 --validation-fraction 0.1 --seed 0 "
                   "--eval-strategy epoch --save-strategy no --logging-steps 20")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (one thread each: 2 on a 2-core machine)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    p.add_argument("--real-tau-top", type=int, default=3, help="decode the best N (and the baseline) for real")
    p.add_argument("--eval-prompts", type=int, default=10)
    p.add_argument("--eval-tokens", type=int, default=64)
    p.add_argument("--table", default=None, help="write the Markdown table here")
    args = p.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("OMP_NUM_THREADS", "1")

    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    todo = [n for n in names if not (out / n / "eagle3_training.json").is_file()]
    commands = {n: [sys.executable, "-m", "eagle3_hf.cli", "train", "--verifier", args.verifier,
                    "--features", args.data_dir, "--output-dir", str(out / n), "--num-train-epochs", str(args.epochs),
                    *shlex.split(args.base_args), *train_args(n, args, out, env)] for n in todo}
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        for name, (rc, seconds) in zip(todo, pool.map(lambda n: run(commands[n], out / f"{n}.log", env), todo)):
            if rc:
                print(f"{name}: FAILED (exit {rc}), see {out / f'{name}.log'}", flush=True)
            else:
                (out / name / "bench_seconds.txt").write_text(f"{seconds:.0f}\n")

    results: dict[str, dict] = {}
    for name in names:
        run_dir = out / name
        summary_file = run_dir / "eagle3_training.json"
        if not summary_file.is_file():
            results[name] = {"failed": True}
            continue
        seconds_file = run_dir / "bench_seconds.txt"
        seconds = float(seconds_file.read_text()) if seconds_file.is_file() else None
        summary = json.loads(summary_file.read_text())
        m = summary["metrics"]
        per_epoch = {round(h["epoch"], 2): h["eval_simulated_acceptance_length"]  # the final evaluate repeats the last
                     for h in summary.get("log_history", []) if "eval_simulated_acceptance_length" in h}
        curve = list(per_epoch.values())
        results[name] = {"sim_tau": m["simulated_acceptance_length"], "acc": m["step_accuracy"],
                         "cacc": m["step_conditional_accuracy"], "seconds": seconds, "curve": curve}
        print(f"{name}: simulated τ {m['simulated_acceptance_length']:.3f}  acc {m['step_accuracy']}", flush=True)

    ranked = sorted((n for n in results if "sim_tau" in results[n]), key=lambda n: -results[n]["sim_tau"])
    for name in dict.fromkeys(ranked[: args.real_tau_top] + (["baseline"] if "baseline" in results else [])):
        if "sim_tau" not in results.get(name, {}):
            continue
        eval_dir = out / name / "eval"
        if not (eval_dir / "eagle3_evaluation.json").is_file():
            rc, _ = run([sys.executable, "-m", "eagle3_hf.cli", "evaluate", "--drafter", str(out / name),
                         "--verifier", args.verifier, "--prompts", "mt-bench", "--num-prompts", str(args.eval_prompts),
                         "--max-new-tokens", str(args.eval_tokens), "--k", "3", "--temperature", "0",
                         "--output", str(eval_dir)], out / f"{name}.eval.log", env)
            if rc:
                print(f"{name}: evaluate FAILED, see {out / f'{name}.eval.log'}", flush=True)
                continue
        ev = json.loads((eval_dir / "eagle3_evaluation.json").read_text())
        results[name]["real_tau"] = ev.get("acceptance_length")
        results[name]["lossless"] = ev.get("lossless")
        print(f"{name}: real τ {results[name]['real_tau']}", flush=True)

    (out / "results.json").write_text(json.dumps(results, indent=2))
    table = format_table(results, args)
    print(table)
    if args.table:
        Path(args.table).write_text(table)


def format_table(results: dict[str, dict], args: argparse.Namespace) -> str:
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = ["# Recipe sweep", "", f"Data: `{args.data_dir}`; {args.epochs} epochs unless varied; base arguments "
             f"`{args.base_args}`; real τ: {args.eval_prompts} MT-bench questions × {args.eval_tokens} tokens, "
             "k = 3, greedy (the baseline and the best by simulated τ).", "",
             "Produced by:", "", "```bash", "python " + " ".join(shlex.quote(a) for a in sys.argv), "```", "",
             "| run | varies | simulated τ | τ per epoch | step acc | cond acc | real τ (MT-bench) | train s |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(results.items(), key=lambda kv: -kv[1].get("sim_tau", 0)):
        if "sim_tau" not in r:
            lines.append(f"| {name} | {CONFIGS[name][0]} | failed | | | | | |")
            continue
        real = f"{r['real_tau']:.3f}" if r.get("real_tau") is not None else "—"
        secs = f"{r['seconds']:.0f}" if r.get("seconds") else "—"
        lines.append(f"| {name} | {CONFIGS[name][0]} | {r['sim_tau']:.3f} | {fmt(r['curve'])} | {fmt(r['acc'])} | "
                     f"{fmt(r['cacc'])} | {real} | {secs} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
