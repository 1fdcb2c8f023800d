"""Tables and plots of experiments/compare_finetune_vs_scratch.py (kept apart so the runs read top to bottom)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(results: dict, path: Path) -> None:
    plt = _pyplot()
    steps = max(int(k.split("_")[-1]) for k in next(iter(results.values()))["curves"] if k.startswith("acc_")) + 1
    fig, axes = plt.subplots(2, steps, figsize=(4 * steps, 6.5), sharex=True, sharey=True, squeeze=False)
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
    plt.close(fig)


def drift_of(result: dict) -> float | None:
    """How far the source's verifier is from ours: 1 - greedy agreement (0 for the same verifier)."""
    if result.get("verifier_drift") is not None:
        return 1.0 - result["verifier_drift"]["greedy_agreement"]
    return 0.0 if result.get("source") else None


def plot_tau_vs_drift(results: dict, path: Path) -> None:
    """Final τ of each finetune against its source verifier's drift, with scratch as the line to beat."""
    plt = _pyplot()
    points = sorted((drift_of(r), run, r) for run, r in results.items()
                    if run != "scratch" and drift_of(r) is not None and "other-layers" not in run)
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p[0] for p in points]
    for key, label, style in (("sim", "simulated τ", "o-"), ("real", "τ (speculative decoding)", "s--")):
        ys = [_tau(p[2], key) for p in points]
        line = ax.plot(xs, ys, style, label=f"finetune: {label}")[0]
        scratch = _tau(results["scratch"], key) if "scratch" in results else None
        if scratch is not None:
            ax.axhline(scratch, color=line.get_color(), linestyle=":", label=f"scratch: {label}")
    for x, run, _r in points:
        ax.annotate(run.split(":", 1)[-1], (x, _tau(_r, "sim")), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlabel("source verifier's drift from ours (1 - greedy agreement)")
    ax.set_ylabel("final τ after finetuning")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tau(result: dict, key: str) -> float | None:
    if key == "sim":
        return result["metrics"]["simulated_acceptance_length"]
    return result["tau"]["acceptance_length"] if result.get("tau") else None


def write_report(results: dict, path: Path, args) -> str:
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = ["| run | source verifier: greedy agreement / KL / aux cosine | source acc before training "
             "(step 0 / τ_sim) | final step acc | final cond acc | simulated τ | τ (speculative decoding) | "
             "lossless | seed / epochs / optimizer steps |", "|---|---|---|---|---|---|---|---|---|"]
    for run, r in results.items():
        d = r.get("verifier_drift")
        drift = (f"{d['greedy_agreement']:.3f} / {d['kl']:.3f} / {d['aux_cosine_mean']:.3f}" if d
                 else ("same verifier" if r.get("source") else "—"))
        before = r.get("source_before")
        before_text = (f"{before['source_acc_0']:.3f} / {before['source_simulated_acceptance_length']:.2f}"
                       if before else "—")
        m, tau, b = r["metrics"], r.get("tau"), r["budget"]
        real = f"{tau['acceptance_length']:.3f} | {tau['lossless']}" if tau else "— | —"
        lines.append(f"| {run} | {drift} | {before_text} | {fmt(m['step_accuracy'])} | "
                     f"{fmt(m['step_conditional_accuracy'])} | {m['simulated_acceptance_length']:.3f} | {real} | "
                     f"{b['seed']} / {b['epochs']:g} / {b['optimizer_steps']} |")
    warnings = [f"- {run}: {w}" for run, r in results.items() for w in r.get("warnings", [])]
    text = "\n".join(lines + ([""] + ["Warnings raised before training:"] + warnings if warnings else []))
    tau_note = (f"τ: {args.eval_prompts} MT-bench questions x {args.eval_tokens} new tokens, k = 3, greedy."
                if args.eval_prompts else "τ by speculative decoding skipped (--eval-prompts 0).")
    path.write_text(text + f"\n\n{tau_note}\n\n![curves](curves.png)\n\n![τ vs drift](tau_vs_drift.png)\n")
    return text
