"""Should I finetune an existing drafter or train from scratch? Run both on the same data, budget and seed.

    python -m experiments.compare_finetune_vs_scratch --data-dir feats/ --source org/existing-eagle3 --output-dir cmp/
    # on the embedded default, building the sources here (see docs/finetune_vs_scratch.md for the measured run):
    python -m experiments.compare_finetune_vs_scratch --data-dir demo_out/small/features \
        --prepared-dir demo_out/small/prepared --build-sources --drift-steps 4 16 --output-dir demo_out/compare

--build-sources trains, on the same prepared conversations and to the same budget (--source-epochs, seed+1):
  matching      a drafter on our verifier's own features;
  other-layers  a drafter on our verifier's features at other aux layers (--other-layers);
  drift-sN      a drafter for a *previous version* of the model: the verifier continued-trained N steps on
                other text (eagle3_hf.drift, cached like the embedded verifier), trained on that version's
                features of the same conversations (features re-extracted, answers not regenerated).
Then every run (scratch and one finetune per source) trains on our data with the same epochs, learning rate
and seed. For each it reports the source's accuracy on our data before training (the diagnosis a user can run
in a minute), curves, final per-step and conditional accuracy, simulated τ and τ by real speculative decoding
on held-out MT-bench prompts. Writes report.md, report.json, curves.png and tau_vs_drift.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from eagle3_hf.training import main as train

# a finished run (and source) is reused only if all of these (and its source) are the same
RUN_KEYS = ("data_dir", "verifier", "epochs", "learning_rate", "max_seq_len", "validation_fraction", "eval_steps",
            "eval_prompts", "eval_tokens", "seed", "source_epochs")



def training_args(args, data_dir: Path, out: Path, epochs: float, seed: int, verifier: str | None = None,
                  extra: list[str] = ()) -> list[str]:
    return ["--verifier", verifier or args.verifier, "--data-dir", str(data_dir), "--output-dir", str(out),
            "--num-train-epochs", str(epochs), "--learning-rate", str(args.learning_rate),
            "--max-seq-len", str(args.max_seq_len), "--per-device-train-batch-size", "2",
            "--warmup-steps", "0.05", "--lr-scheduler-type", "cosine", "--seed", str(seed),
            "--validation-fraction", str(args.validation_fraction), "--eval-strategy", "steps",
            "--eval-steps", str(args.eval_steps), "--logging-steps", str(args.eval_steps), "--save-strategy", "no",
            "--disable-tqdm", "true", *extra]


def source_features(args, verifier_name: str, out: Path, aux: list[int]) -> Path:
    """Features of the same prepared conversations from another verifier (version) or other aux layers."""
    from eagle3_hf.assets import load_verifier
    from eagle3_hf.data.extract import extract_features
    from eagle3_hf.data.shards import load_manifest

    manifest = load_manifest(args.data_dir)
    if not (out / "manifest.json").is_file():  # extraction resumes where a killed run stopped
        extract_features(load_verifier(verifier_name), manifest["tokenizer_fingerprint"], args.prepared_dir, out,
                         aux_indices=aux, dtype=manifest["dtype"], verifier_name=verifier_name, progress=False)
    shutil.copyfile(Path(args.data_dir) / "vocab.safetensors", out / "vocab.safetensors")
    return out


def held_out_ids(args) -> list:
    from eagle3_hf.data.prepare import load_prepared

    return load_prepared(args.prepared_dir)[0]["input_ids"][: args.drift_held_out]


def drift_measurement(args, out: Path, steps: int, path: Path, aux: list[int]) -> dict:
    """How far the drifted verifier is from ours on our prepared samples (cached: a few forwards of both)."""
    from eagle3_hf.assets import load_verifier
    from eagle3_hf.drift import measure_drift, weight_change

    cached = out / f"drift-s{steps}.json"
    if cached.is_file() and json.loads(cached.read_text()).get("dir") == str(path):
        return json.loads(cached.read_text())
    ours, drifted = load_verifier(args.verifier), load_verifier(str(path))
    drift = {"steps": steps, "lr": args.drift_lr, "dir": str(path), "weight_change": weight_change(ours, drifted),
             "held_out_samples": args.drift_held_out, **measure_drift(ours, drifted, held_out_ids(args), aux)}
    cached.write_text(json.dumps(drift, indent=2))
    return drift


def build_sources(args, out: Path, wanted=lambda name: True) -> dict[str, dict]:
    """Drafters trained here, each on its own verifier's features of the same conversations, same budget."""
    from eagle3_hf.data.shards import load_manifest
    from eagle3_hf.drift import DriftRecipe, build_drifted_verifiers

    aux = list(load_manifest(args.data_dir)["aux_layer_indices"])
    plan = {"matching": (args.verifier, aux, None), "other-layers": (args.verifier, args.other_layers, None)}
    if args.drift_steps:
        drifted = build_drifted_verifiers(args.verifier, args.drift_steps, DriftRecipe(lr=args.drift_lr))
        for steps, path in drifted.items():
            plan[f"drift-s{steps}"] = (str(path), aux, drift_measurement(args, out, steps, path, aux))
    sources = {}
    for name, (verifier, layers, drift) in plan.items():
        target = out / f"source_{name}"
        if wanted(f"finetune:{name}") and not (target / "model.safetensors").is_file():
            data = (Path(args.data_dir) if name == "matching"
                    else source_features(args, verifier, out / f"features_{name}", layers))
            train(training_args(args, data, target, args.source_epochs, args.seed + 1, verifier))
        sources[name] = {"dir": str(target), "verifier_drift": drift}
    return sources


def curves(summary: dict) -> dict[str, list]:
    evals = [h for h in summary["log_history"] if "eval_acc_0" in h]
    steps = len(summary["metrics"]["step_accuracy"])
    return {"step": [h["step"] for h in evals],
            **{f"acc_{i}": [h[f"eval_acc_{i}"] for h in evals] for i in range(steps)},
            **{f"cond_acc_{i}": [h[f"eval_cond_acc_{i}"] for h in evals] for i in range(steps)},
            "simulated_tau": [h.get("eval_simulated_acceptance_length") for h in evals]}


def measure_tau(args, drafter_dir: str) -> dict:
    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.assets import load_tokenizer, load_verifier, mtbench_questions
    from eagle3_hf.evaluate import evaluate_drafter

    verifier = load_verifier(args.verifier)
    drafter = Eagle3DraftModel.from_pretrained(drafter_dir, verifier=verifier)
    tau = evaluate_drafter(verifier, drafter, load_tokenizer(args.verifier), mtbench_questions(args.eval_prompts),
                           k=3, max_new_tokens=args.eval_tokens, prompts_name="mt-bench", progress=False)
    tau.pop("per_prompt", None)
    return tau


def budget(args, summary: dict) -> dict:
    """What every run must share for the comparison to mean anything."""
    return {"seed": args.seed, "epochs": args.epochs, "learning_rate": args.learning_rate,
            "max_seq_len": args.max_seq_len, "data": str(args.data_dir),
            "optimizer_steps": max((h.get("step", 0) for h in summary["log_history"]), default=0),
            "train_tokens": summary["data"]["num_tokens"]}


def run_once(args, run: str, source: dict, target: Path) -> dict:
    """Train one run (or reuse it when a finished one had the same source, data, budget and evaluation)."""
    cached = target / "compare_result.json"
    key = {"source": source.get("dir"), **{k: str(v) for k, v in vars(args).items() if k in RUN_KEYS}}
    if cached.is_file():
        saved = json.loads(cached.read_text())
        if saved.get("key") == key:
            return saved["result"]
    extra = ["--finetune-from", source["dir"]] if source else []
    summary = train(training_args(args, args.data_dir, target, args.epochs, args.seed, extra=extra))
    result = {"source": source.get("dir"), "verifier_drift": source.get("verifier_drift"),
              "budget": budget(args, summary), "metrics": summary["metrics"], "curves": curves(summary),
              "source_before": summary["init"].get("source_metrics"),
              "warnings": summary["init"].get("warnings", []),
              "advice": summary["init"].get("advice"),
              "tau": measure_tau(args, str(target)) if args.eval_prompts else None}
    cached.write_text(json.dumps({"key": key, "result": result}, indent=2))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--prepared-dir", help="needed with --build-sources (to extract other layers / versions)")
    parser.add_argument("--source", action="append", default=[], help="NAME=DIR_OR_REPO (repeatable)")
    parser.add_argument("--build-sources", action="store_true")
    parser.add_argument("--other-layers", default="1,8,20", help="aux layers of the other-layers source")
    parser.add_argument("--drift-steps", type=int, nargs="*", default=[],
                        help="with --build-sources: sources for drifted versions of the verifier (optimizer steps)")
    parser.add_argument("--drift-lr", type=float, default=3e-4)
    parser.add_argument("--drift-held-out", type=int, default=12, help="prepared samples the drift is measured on")
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--source-epochs", type=float, default=2)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--validation-fraction", type=float, default=0.1)
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=5, help="MT-bench questions for τ (0: skip)")
    parser.add_argument("--eval-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", metavar="RUN",
                        help="just these runs (e.g. scratch finetune:drift-s4), in the report too: split the work over "
                             "several processes, then one invocation without --only reuses them all")
    args = parser.parse_args(argv)
    args.other_layers = [int(x) for x in args.other_layers.split(",")]
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

    runs = {"scratch": {}, **{f"finetune:{name}": src for name, src in sources.items()}}
    if args.only and set(args.only) - set(runs):
        parser.error(f"--only {sorted(set(args.only) - set(runs))}: not among the runs {list(runs)}")
    results = {run: run_once(args, run, source, out / run.replace(":", "_"))
               for run, source in runs.items() if wanted(run)}
    (out / "report.json").write_text(json.dumps(results, indent=2))
    plot_curves(results, out / "curves.png")
    plot_tau_vs_drift(results, out / "tau_vs_drift.png")
    print(write_report(results, out / "report.md", args))
    return results


if __name__ == "__main__":
    main()
