"""Should I finetune an existing drafter or train from scratch? Run both on the same data, budget and seed.

    python examples/compare_finetune_vs_scratch.py --data-dir feats/ --source org/existing-eagle3 --output-dir cmp/
    # on the embedded default, building the sources here: one trained for OTHER aux layers (a mismatch,
    # like a drafter trained on another model's hidden states) and one trained on matching features
    python examples/compare_finetune_vs_scratch.py --data-dir demo_out/small/features \
        --prepared-dir demo_out/small/prepared --build-sources --output-dir demo_out/compare

For each source it reports the source's accuracy before any training (the mismatch diagnosis), per-step
accuracy and conditional accuracy curves over training for scratch vs finetune, and the final τ by real
speculative decoding on held-out MT-bench prompts. Writes report.md, report.json and curves.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle3_hf.training import main as train

MISMATCHED_AUX = (1, 8, 20)  # layers a drafter for the 30-layer default verifier normally never reads


def training_args(args, data_dir: Path, out: Path, epochs: float, extra: list[str] = ()) -> list[str]:
    return ["--verifier", args.verifier, "--data-dir", str(data_dir), "--output-dir", str(out),
            "--num-train-epochs", str(epochs), "--learning-rate", str(args.learning_rate),
            "--max-seq-len", str(args.max_seq_len), "--per-device-train-batch-size", "2",
            "--warmup-steps", "0.05", "--lr-scheduler-type", "cosine", "--seed", str(args.seed),
            "--validation-fraction", str(args.validation_fraction), "--eval-strategy", "steps",
            "--eval-steps", str(args.eval_steps), "--logging-steps", str(args.eval_steps), "--save-strategy", "no",
            "--disable-tqdm", "true", *extra]


def build_sources(args, out: Path) -> dict[str, str]:
    """A matching source (same features, another seed, shorter budget) and a mismatched one (features of
    other aux layers), both trained here so the comparison runs offline on the embedded default."""
    from eagle3_hf.assets import load_verifier
    from eagle3_hf.data.extract import extract_features
    from eagle3_hf.data.shards import load_manifest

    manifest = load_manifest(args.data_dir)
    verifier = load_verifier(args.verifier)
    other = out / "features_other_layers"
    if not (other / "manifest.json").is_file():
        extract_features(verifier, manifest["tokenizer_fingerprint"], args.prepared_dir, other,
                         aux_indices=list(MISMATCHED_AUX), dtype=manifest["dtype"], verifier_name=args.verifier)
    (other / "vocab.safetensors").write_bytes((Path(args.data_dir) / "vocab.safetensors").read_bytes())
    sources = {}
    for name, data in (("matching", Path(args.data_dir)), ("mismatched", other)):
        target = out / f"source_{name}"
        if not (target / "model.safetensors").is_file():
            train(training_args(args, data, target, args.source_epochs, ["--seed", str(args.seed + 1)]))
        sources[name] = str(target)
    return sources


def curves(summary: dict) -> dict[str, list]:
    evals = [h for h in summary["log_history"] if "eval_acc_0" in h]
    steps = len(summary["metrics"]["step_accuracy"])
    return {"step": [h["step"] for h in evals],
            **{f"acc_{i}": [h[f"eval_acc_{i}"] for h in evals] for i in range(steps)},
            **{f"cond_acc_{i}": [h[f"eval_cond_acc_{i}"] for h in evals] for i in range(steps)}}


def measure_tau(args, drafter_dir: str) -> dict:
    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.assets import load_tokenizer, load_verifier, mtbench_questions
    from eagle3_hf.speculative import evaluate_drafter

    verifier = load_verifier(args.verifier)
    drafter = Eagle3DraftModel.from_pretrained(drafter_dir, verifier=verifier)
    return evaluate_drafter(verifier, drafter, load_tokenizer(args.verifier), mtbench_questions(args.eval_prompts),
                            k=3, max_new_tokens=args.eval_tokens, prompts_name="mt-bench", progress=False)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = max(int(k.split("_")[-1]) for k in next(iter(results.values()))["curves"] if k.startswith("acc_")) + 1
    fig, axes = plt.subplots(2, steps, figsize=(4 * steps, 6.5), sharex=True, sharey=True)
    for run, result in results.items():
        c = result["curves"]
        for i in range(steps):
            axes[0][i].plot(c["step"], c[f"acc_{i}"], marker=".", label=run)
            axes[1][i].plot(c["step"], c[f"cond_acc_{i}"], marker=".", label=run)
            axes[0][i].set_title(f"step {i} accuracy")
            axes[1][i].set_title(f"step {i} conditional accuracy")
            axes[1][i].set_xlabel("optimizer step")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results: dict, path: Path) -> str:
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = ["| run | source acc before training (step 0 / τ_sim) | final step acc | final cond acc | "
             "simulated τ | τ (speculative decoding) | lossless |", "|---|---|---|---|---|---|---|"]
    for run, r in results.items():
        before = r.get("source_before")
        before_text = (f"{before['source_acc_0']:.3f} / {before['source_simulated_acceptance_length']:.2f}"
                       if before else "—")
        m, tau = r["metrics"], r["tau"]
        lines.append(f"| {run} | {before_text} | {fmt(m['step_accuracy'])} | {fmt(m['step_conditional_accuracy'])} "
                     f"| {m['simulated_acceptance_length']:.3f} | {tau['acceptance_length']:.3f} | {tau['lossless']} |")
    warnings = [f"- {run}: {w}" for run, r in results.items() for w in r.get("warnings", [])]
    text = "\n".join(lines + ([""] + ["Warnings raised before training:"] + warnings if warnings else []))
    path.write_text(text + "\n\n![curves](curves.png)\n")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--prepared-dir", help="needed with --build-sources (to extract other layers)")
    parser.add_argument("--source", action="append", default=[], help="NAME=DIR_OR_REPO (repeatable)")
    parser.add_argument("--build-sources", action="store_true")
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--source-epochs", type=float, default=2)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--validation-fraction", type=float, default=0.1)
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--eval-prompts", type=int, default=5)
    parser.add_argument("--eval-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=True)
    sources = dict(s.split("=", 1) if "=" in s else ("source", s) for s in args.source)
    if args.build_sources:
        if not args.prepared_dir:
            parser.error("--build-sources needs --prepared-dir")
        sources.update(build_sources(args, out))
    if not sources:
        parser.error("give --source NAME=DIR_OR_REPO or --build-sources")

    runs = {"scratch": None, **{f"finetune:{name}": src for name, src in sources.items()}}
    results = {}
    for run, source in runs.items():
        target = out / run.replace(":", "_")
        extra = ["--finetune-from", source] if source else []
        summary = train(training_args(args, Path(args.data_dir), target, args.epochs, extra))
        results[run] = {"metrics": summary["metrics"], "curves": curves(summary),
                        "source_before": summary["init"].get("source_metrics"),
                        "warnings": summary["init"].get("warnings", []),
                        "tau": measure_tau(args, str(target))}
        results[run]["tau"].pop("per_prompt", None)
    (out / "report.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "curves.png")
    print(report(results, out / "report.md"))


if __name__ == "__main__":
    main()
