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


def margins(results: dict) -> dict[str, dict]:
    """Per source: its step-0 accuracy on our data before training and finetune - scratch at each budget run
    (simulated τ on validation decides; real τ alongside). A source wins where every budget's margin is > 0."""
    out: dict[str, dict] = {}
    for run, r in results.items():
        if not run.startswith("finetune:"):
            continue
        name, _, long = run.partition("@")
        scratch = results.get("scratch@long" if long else "scratch")
        if scratch is None or not r.get("source_before"):
            continue
        entry = out.setdefault(name.split(":", 1)[1], {"acc0": r["source_before"]["source_acc_0"], "by_budget": {}})
        real = (r["tau"]["acceptance_length"] - scratch["tau"]["acceptance_length"]
                if r.get("tau") and scratch.get("tau") else None)
        entry["by_budget"][r["budget"]["optimizer_steps"]] = {
            "sim": r["metrics"]["simulated_acceptance_length"] - scratch["metrics"]["simulated_acceptance_length"],
            "real": real}
    for entry in out.values():
        entry["won"] = all(m["sim"] > 0 for m in entry["by_budget"].values())
    return out


def threshold(results: dict) -> tuple[float | None, str]:
    """(bound, sentence): the lowest source step-0 accuracy above which every measured source beat scratch at
    every budget run, and what the measurements say below it."""
    m = margins(results)
    winners = sorted(e["acc0"] for e in m.values() if e["won"])
    losers = sorted(e["acc0"] for e in m.values() if not e["won"])
    above = [a for a in winners if not losers or a > losers[-1]]
    if not above:
        return None, (f"no measured source beat scratch at every budget (losers' step-0 accuracy "
                      f"{', '.join(f'{a:.3f}' for a in losers)}): nothing here supports finetuning")
    bound = above[0]
    text = f"every source at or above {bound:.3f} step-0 accuracy beat scratch at every budget run"
    text += (f"; sources at {', '.join(f'{a:.3f}' for a in losers)} lost at some budget" if losers
             else "; no measured source lost")
    return bound, text


def write_report(results: dict, path: Path, args) -> str:
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    lines = ["| run | source verifier: greedy agreement / KL / aux cosine | source's own training: verifier / "
             "conversations / tokens / draft vocab | source optimizer steps | source acc on our data before "
             "training (step 0 / τ_sim) | final step acc | final cond acc | simulated τ | τ (speculative decoding) | "
             "lossless | comparison budget: seed / epochs / optimizer steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run, r in results.items():
        d, t = r.get("verifier_drift"), r.get("source_training")
        drift = (f"{d['greedy_agreement']:.3f} / {d['kl']:.3f} / {d['aux_cosine_mean']:.3f}" if d
                 else ("same verifier" if r.get("source") else "—"))
        own = (f"{t['verifier']} / {t['conversations']} / {t['train_tokens']:,} / {t['draft_vocab_size']}" if t
               else ("published" if r.get("source") else "—"))
        before = r.get("source_before")
        before_text = (f"{before['source_acc_0']:.3f} / {before['source_simulated_acceptance_length']:.2f}"
                       if before else "—")
        m, tau, b = r["metrics"], r.get("tau"), r["budget"]
        real = f"{tau['acceptance_length']:.3f} | {tau['lossless']}" if tau else "— | —"
        lines.append(f"| {run} | {drift} | {own} | {t['optimizer_steps'] if t else '—'} | {before_text} | "
                     f"{fmt(m['step_accuracy'])} | {fmt(m['step_conditional_accuracy'])} | "
                     f"{m['simulated_acceptance_length']:.3f} | {real} | {b['seed']} / {b['epochs']:g} / "
                     f"{b['optimizer_steps']} |")
    lines += ["", "| source | step-0 acc before | finetune − scratch, simulated τ (real τ), at each comparison budget "
              "(optimizer steps) | beat scratch at every budget |", "|---|---|---|---|"]
    for name, e in margins(results).items():
        real = lambda mm: "—" if mm["real"] is None else f"{mm['real']:+.3f}"  # noqa: E731
        per = ", ".join(f"{steps} steps: {mm['sim']:+.3f} ({real(mm)})" for steps, mm in sorted(e["by_budget"].items()))
        lines.append(f"| {name} | {e['acc0']:.3f} | {per} | {e['won']} |")
    bound, sentence = threshold(results)
    lines += ["", f"Threshold: SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH = {'none' if bound is None else f'{bound:.3f}'}"
              f" ({sentence})."]
    warnings = [f"- {run}: {w}" for run, r in results.items() for w in r.get("warnings", [])]
    text = "\n".join(lines + ([""] + ["Warnings raised before training:"] + warnings if warnings else []))
    tau_note = (f"τ: {args.eval_prompts} prompts of {args.eval_set} x {args.eval_tokens} new tokens, k = 3, greedy."
                if args.eval_prompts else "τ by speculative decoding skipped (--eval-prompts 0).")
    path.write_text(text + f"\n\n{tau_note}\n\n![curves](curves.png)\n\n![τ vs drift](tau_vs_drift.png)\n")
    return text
