"""Should I finetune an existing drafter or train from scratch? Both on our data, at the same target-side budget.

    python -m experiments.compare_finetune_vs_scratch --features feats/ --source pub=org/eagle3 --output-dir cmp/
    # on the embedded default, building the sources here (docs/results/finetune_vs_scratch.md has the measured run):
    python -m experiments.compare_finetune_vs_scratch --features runs/cmp/ours/features \\
        --prepared-dir runs/cmp/ours/prepared --conversations runs/cmp/ours/conversations.jsonl \\
        --build-sources --drift-steps 8 --other-vocab-size 1024 --output-dir runs/cmp/out --epochs 2 --long-epochs 8

--build-sources makes the drafters a user would find published for the previous version of their model: each
is trained on *other conversations* (`--source-prompts` short prompts that are not in our data, checked by id
and by text overlap) answered by *its own verifier version*, for `--source-epochs`:
  disjoint              our verifier answered the other prompts (other data, same model version);
  disjoint-drift-sN     a previous version of the model (our verifier continued-trained N steps on other text,
                        experiments.drift) regenerated the other prompts' answers, its features, our vocabulary;
  disjoint-drift-sN-vocabM  the same source data with its own draft vocabulary of M tokens built from it (as a
                        published drafter would have); finetuning remaps lm_head rows to ours (--finetune-vocab
                        dataset).
The source's own training (verifier, data, optimizer steps, tokens) is reported apart from the comparison
budget. Every run then trains on our data: scratch and one finetune per source with the same epochs, learning
rate and seed (`--epochs`, the equal target-side budget) and, with `--long-epochs`, again at a budget where
scratch's validation curve has flattened (the report shows its curve). For each run: the source's accuracy on
our data before training (the diagnosis `--finetune-from` logs), curves, final per-step and conditional
accuracy, simulated τ and τ by real speculative decoding (`--eval-set`, MT-bench by default). Writes
report.md, report.json, curves.png and tau_vs_drift.png; the threshold line of report.md is what
eagle3_hf/train/setup.py's SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH states.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle3_hf.scripts.train import main as train

# a finished run (and source) is reused only if all of these (and its source) are the same
RUN_KEYS = ("data_dir", "verifier", "learning_rate", "max_seq_len", "validation_fraction", "eval_steps",
            "eval_prompts", "eval_tokens", "eval_set", "seed")
SOURCE_KEYS = ("source_prompts", "source_tokens", "source_epochs", "learning_rate", "max_seq_len", "seed")


def training_args(args, data_dir: Path, out: Path, epochs: float, seed: int, verifier: str | None = None,
                  extra: list[str] = ()) -> list[str]:
    return ["--verifier", verifier or args.verifier, "--features", str(data_dir), "--output-dir", str(out),
            "--num-train-epochs", str(epochs), "--learning-rate", str(args.learning_rate),
            "--max-seq-len", str(args.max_seq_len), "--per-device-train-batch-size", "2",
            "--warmup-steps", "0.05", "--lr-scheduler-type", "cosine", "--seed", str(seed),
            "--validation-fraction", str(args.validation_fraction), "--eval-strategy", "steps",
            "--eval-steps", str(args.eval_steps), "--logging-steps", str(args.eval_steps), "--save-strategy", "no",
            "--disable-tqdm", "true", *extra]


def optimizer_steps(summary: dict) -> int:
    return max((h.get("step", 0) for h in summary["log_history"]), default=0)


# ---------------------------------------------------------------- sources on other data, by their own version

def source_prompts(args) -> list[dict]:
    """`--source-prompts` short prompts that are not in our data, by id and by text (eagle3_hf.demo_data.overlap)."""
    from eagle3_hf.demo_data.overlap import find_overlaps
    from eagle3_hf.demo_data.prompts import short_prompts
    from eagle3_hf.features.store import load_manifest

    ours = {s["id"] for s in load_manifest(args.data_dir)["samples"]}
    pool = [p for p in short_prompts(len(ours) + 2 * args.source_prompts) if p["id"] not in ours]
    if args.conversations:  # nor a retyped one of ours (chat openers repeat: "hi, how are you?")
        from eagle3_hf.data.conversations import iter_jsonl

        overlapping = {f["id"] for f in find_overlaps(pool, (row for _, row in iter_jsonl(args.conversations)))}
        pool = [p for p in pool if p["id"] not in overlapping]
    if len(pool) < args.source_prompts:
        raise SystemExit(f"--source-prompts {args.source_prompts}: only {len(pool)} short prompts outside the data")
    return pool[: args.source_prompts]


def source_data(args, out: Path, name: str, verifier: str, aux: list[int]) -> Path:
    """The source's own conversations: the other prompts answered by its verifier version, prepared and
    extracted by it (what its authors would have trained on). Resumes: existing ids are skipped."""
    from eagle3_hf.cli import main as cli

    data = out / f"source_data_{name}"
    if not (data / "features" / "manifest.json").is_file():
        data.mkdir(parents=True, exist_ok=True)
        prompts = data / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in source_prompts(args)))
        code = cli(["regenerate", "--input", str(prompts), "--output", str(data / "conversations.jsonl"),
                    "--verifier", verifier, "--max-new-tokens", str(args.source_tokens), "--batch-size", "16",
                    "--num-workers", "1", "--features-out", str(data / "features"), "--prepared-out",
                    str(data / "prepared"), "--max-seq-len", str(args.max_seq_len), "--features-dtype", "bf16",
                    "--aux-layers", ",".join(map(str, aux))])
        if code:
            raise SystemExit(f"regenerating the source data {data} failed ({code})")
    return data


def source_vocab(args, data: Path, size: int | None) -> Path:
    """Our vocabulary (None), or the source's own of `size` tokens built from its own data."""
    from eagle3_hf.cli import main as cli

    if size is None:
        return Path(args.data_dir) / "vocab.safetensors"
    path = data / f"vocab-{size}.safetensors"
    if not path.is_file() and cli(["vocab", "--data", str(data / "prepared"), "--draft-vocab-size", str(size),
                                   "--output", str(path)]):
        raise SystemExit(f"building the source vocabulary {path} failed")
    return path


def drift_measurement(args, out: Path, steps: int, path: Path, aux: list[int]) -> dict:
    """How far the drifted verifier is from ours on our prepared samples (cached: a few forwards of both)."""
    from eagle3_hf.data.prepared_format import load_prepared
    from eagle3_hf.verifier.loading import load_verifier

    from experiments.drift import measure_drift, weight_change

    cached = out / f"drift-s{steps}.json"
    if cached.is_file() and json.loads(cached.read_text()).get("dir") == str(path):
        return json.loads(cached.read_text())
    ours, drifted = load_verifier(args.verifier), load_verifier(str(path))
    held_out = load_prepared(args.prepared_dir)[0]["input_ids"][: args.drift_held_out]
    drift = {"steps": steps, "lr": args.drift_lr, "dir": str(path), "weight_change": weight_change(ours, drifted),
             "held_out_samples": args.drift_held_out, **measure_drift(ours, drifted, held_out, aux)}
    cached.write_text(json.dumps(drift, indent=2))
    return drift


def build_sources(args, out: Path, wanted=lambda name: True) -> dict[str, dict]:
    """Drafters trained on other conversations, each answered and extracted by its own verifier version."""
    from eagle3_hf.features.store import load_manifest

    from experiments.drift import DriftRecipe, build_drifted_verifiers

    aux = list(load_manifest(args.data_dir)["aux_layer_indices"])
    plan = {"disjoint": ("same", args.verifier, None, None)}
    if args.drift_steps:
        drifted = build_drifted_verifiers(args.verifier, args.drift_steps, DriftRecipe(lr=args.drift_lr))
        for steps, path in drifted.items():
            drift = drift_measurement(args, out, steps, path, aux)
            plan[f"disjoint-drift-s{steps}"] = (f"drift-s{steps}", str(path), drift, None)
        if args.other_vocab_size:
            steps = max(drifted)
            plan[f"disjoint-drift-s{steps}-vocab{args.other_vocab_size}"] = (
                f"drift-s{steps}", str(drifted[steps]), plan[f"disjoint-drift-s{steps}"][2], args.other_vocab_size)
    sources = {}
    for name, (version, verifier, drift, vocab_size) in plan.items():
        if not any(wanted(f"finetune:{name}{suffix}") for suffix in ("", "@long")):
            continue
        target = out / f"source_{name}"
        key = {k: str(getattr(args, k)) for k in SOURCE_KEYS} | {"verifier": verifier, "vocab_size": vocab_size}
        saved = target / "source_training.json"
        if not (saved.is_file() and json.loads(saved.read_text())["key"] == key):
            data = source_data(args, out, version, verifier, aux)
            vocab = source_vocab(args, data, vocab_size)
            summary = train(training_args(args, data / "features", target, args.source_epochs, args.seed + 1,
                                          verifier, extra=["--vocab", str(vocab)]))
            training = {"verifier": version, "data": str(data), "conversations": summary["data"]["num_samples"],
                        "train_tokens": summary["data"]["num_tokens"], "epochs": args.source_epochs,
                        "optimizer_steps": optimizer_steps(summary), "seed": args.seed + 1,
                        "draft_vocab_size": vocab_size or "ours"}
            saved.write_text(json.dumps({"key": key, "training": training}, indent=2))
        sources[name] = {"dir": str(target), "verifier_drift": drift,
                         "source_training": json.loads(saved.read_text())["training"]}
    return sources


# ---------------------------------------------------------------- the comparison runs on our data

def curves(summary: dict) -> dict[str, list]:
    evals = [h for h in summary["log_history"] if "eval_acc_0" in h]
    steps = len(summary["metrics"]["step_accuracy"])
    return {"step": [h["step"] for h in evals],
            **{f"acc_{i}": [h[f"eval_acc_{i}"] for h in evals] for i in range(steps)},
            **{f"cond_acc_{i}": [h[f"eval_cond_acc_{i}"] for h in evals] for i in range(steps)},
            "simulated_tau": [h.get("eval_simulated_acceptance_length") for h in evals]}


def measure_tau(args, drafter_dir: str) -> dict:
    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.evaluation.evaluate import evaluate_drafter, load_prompts
    from eagle3_hf.verifier.loading import load_tokenizer, load_verifier

    verifier = load_verifier(args.verifier)
    drafter = Eagle3DraftModel.from_pretrained(drafter_dir, verifier=verifier)
    prompts, name = load_prompts(args.eval_set, args.eval_prompts)
    tau = evaluate_drafter(verifier, drafter, load_tokenizer(args.verifier), prompts, k=3,
                           max_new_tokens=args.eval_tokens, prompts_name=name, progress=False)
    tau.pop("per_prompt", None)
    return tau


def budget(args, summary: dict, epochs: float) -> dict:
    """The comparison budget on our data, read from what the run did (the source's own training is apart)."""
    return {"seed": args.seed, "epochs": epochs, "learning_rate": args.learning_rate,
            "max_seq_len": args.max_seq_len, "data": str(args.data_dir),
            "optimizer_steps": optimizer_steps(summary), "train_tokens": summary["data"]["num_tokens"]}


def run_once(args, run: str, source: dict, target: Path, epochs: float) -> dict:
    """Train one run (or reuse it when a finished one had the same source, data, budget and evaluation)."""
    cached = target / "compare_result.json"
    key = {"source": source.get("dir"), "source_training": source.get("source_training"), "epochs": epochs,
           **{k: str(v) for k, v in vars(args).items() if k in RUN_KEYS}}
    if cached.is_file():
        saved = json.loads(cached.read_text())
        if saved.get("key") == key:
            return saved["result"]
    extra = ["--finetune-from", source["dir"], "--finetune-vocab", "dataset"] if source else []
    summary = train(training_args(args, args.data_dir, target, epochs, args.seed, extra=extra))
    result = {"source": source.get("dir"), "verifier_drift": source.get("verifier_drift"),
              "source_training": source.get("source_training"),
              "budget": budget(args, summary, epochs), "metrics": summary["metrics"], "curves": curves(summary),
              "source_before": summary["init"].get("source_metrics"),
              "warnings": summary["init"].get("warnings", []),
              "advice": summary["init"].get("advice"),
              "tau": measure_tau(args, str(target)) if args.eval_prompts else None}
    cached.write_text(json.dumps({"key": key, "result": result}, indent=2))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", dest="data_dir", required=True, type=Path)
    parser.add_argument("--prepared-dir", help="needed with --build-sources (drift measured on it)")
    parser.add_argument("--conversations", type=Path,
                        help="our conversations (JSONL): source prompts overlapping them are skipped")
    parser.add_argument("--source", action="append", default=[], help="NAME=DIR_OR_REPO (repeatable)")
    parser.add_argument("--build-sources", action="store_true")
    parser.add_argument("--source-prompts", type=int, default=96, help="other short prompts the sources train on")
    parser.add_argument("--source-tokens", type=int, default=48, help="new tokens per source answer")
    parser.add_argument("--source-epochs", type=float, default=2)
    parser.add_argument("--drift-steps", type=int, nargs="*", default=[],
                        help="with --build-sources: sources for drifted versions of the verifier (optimizer steps)")
    parser.add_argument("--drift-lr", type=float, default=3e-4)
    parser.add_argument("--drift-held-out", type=int, default=12, help="prepared samples the drift is measured on")
    parser.add_argument("--other-vocab-size", type=int, default=0,
                        help="also a source for the strongest drift with its own draft vocabulary of this size")
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--epochs", type=float, default=2, help="the equal target-side budget")
    parser.add_argument("--long-epochs", type=float, default=0, help="also every run at this budget (0: skip)")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--validation-fraction", type=float, default=0.15)
    parser.add_argument("--eval-steps", type=int, default=12)
    parser.add_argument("--eval-set", default="mt-bench", help="prompts for real τ (evaluate --prompts)")
    parser.add_argument("--eval-prompts", type=int, default=4, help="prompts for real τ (0: skip)")
    parser.add_argument("--eval-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", metavar="RUN",
                        help="just these runs (e.g. scratch finetune:disjoint scratch@long), in the report too: "
                             "split the work over several processes, then one invocation without --only reuses them")
    args = parser.parse_args(argv)
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    wanted = (lambda run: run in args.only) if args.only else (lambda run: True)
    sources = {name: {"dir": src} for name, src in
               (s.split("=", 1) if "=" in s else ("source", s) for s in args.source)}
    if args.build_sources:
        if not args.prepared_dir:
            parser.error("--build-sources needs --prepared-dir")
        sources.update(build_sources(args, out, wanted))
    if not sources:
        parser.error("give --source NAME=DIR_OR_REPO or --build-sources")

    from experiments.compare_report import plot_curves, plot_tau_vs_drift, write_report

    runs = {"scratch": ({}, args.epochs), **{f"finetune:{n}": (s, args.epochs) for n, s in sources.items()}}
    if args.long_epochs:
        runs |= {f"{run}@long": (source, args.long_epochs) for run, (source, _) in list(runs.items())}
    if args.only and set(args.only) - set(runs):
        parser.error(f"--only {sorted(set(args.only) - set(runs))}: not among the runs {list(runs)}")
    results = {run: run_once(args, run, source, out / run.replace(":", "_").replace("@", "_"), epochs)
               for run, (source, epochs) in runs.items() if wanted(run)}
    (out / "report.json").write_text(json.dumps(results, indent=2))
    plot_curves(results, out / "curves.png")
    plot_tau_vs_drift({r: v for r, v in results.items() if "@long" not in r}, out / "tau_vs_drift.png")
    print(write_report(results, out / "report.md", args))
    return results


if __name__ == "__main__":
    main()
