"""Print (and save as summary.md / summary.json) the demo's table from the artifacts it wrote.

With --results PAGE it also writes the committed results page (the command, commit and machine, then the table)
and puts the same table into README.md between the demo-table markers; tests/test_demo_table.py checks that the
two agree. From a finished small demo, one command refreshes both (the wall time is kept from summary.json):

    python examples/demo_summary.py demo_out/small --results docs/results/demo.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- demo-table: begin (written by examples/demo_summary.py) -->", "<!-- demo-table: end -->"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _optional_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def summarize(out: Path, seconds: int | None = None) -> dict:
    manifest = json.loads((out / "features" / "manifest.json").read_text())
    training = json.loads((out / "drafter" / "eagle3_training.json").read_text())
    evaluation = json.loads((out / "eval" / "eagle3_evaluation.json").read_text())
    timings = dict(line.split() for line in (out / "timings.txt").read_text().splitlines() if line.strip())
    tokens = sum(int(s["length"]) for s in manifest["samples"])
    hidden = int(manifest["verifier"]["hidden_size"])
    feature_bytes = sum(p.stat().st_size for p in (out / "features").glob("shard-*.safetensors"))
    metrics = training["metrics"]
    return {
        "samples": len(manifest["samples"]),
        "tokens": tokens,
        "train_samples": training["data"]["num_samples"],
        "train_tokens": training["data"]["num_tokens"],
        "feature_bytes": feature_bytes,
        "bytes_per_token": round(feature_bytes / max(tokens, 1), 1),
        "reference_bytes_per_token": 4 * hidden * 2,
        "checkpoint_bytes": dir_bytes(out / "export"),
        "seconds": {k: int(v) for k, v in timings.items()},
        "total_seconds": seconds,
        "step_accuracy": metrics["step_accuracy"],
        "step_conditional_accuracy": metrics["step_conditional_accuracy"],
        "simulated_acceptance_length": metrics["simulated_acceptance_length"],
        "acceptance_length": evaluation["acceptance_length"],
        "per_position_acceptance": evaluation["per_position_acceptance"],
        "speedup": evaluation["speedup"],
        "lossless": evaluation["lossless"],
        "eval": {k: evaluation[k] for k in ("engine", "k", "temperature", "prompts", "num_prompts")},
        "tree": _tree(out),
        "vllm": _vllm(out),
        "llamacpp": _llamacpp(out),
    }


def _tree(out: Path) -> dict | None:
    """The fastest tree of the sweep (development prompts) and its run on the evaluation questions."""
    sweep = _optional_json(out / "sweep" / "eagle3_sweep.json")
    ev = _optional_json(out / "eval_tree" / "eagle3_evaluation.json")
    if not sweep or not ev:
        return None
    return {"steps": ev.get("k"), "topk": ev.get("topk"), "num_draft_tokens": ev.get("num_draft_tokens"),
            "acceptance_length": ev["acceptance_length"], "per_position_acceptance": ev["per_position_acceptance"],
            "speedup": ev["speedup"], "lossless": ev["lossless"], "sglang_flags": sweep.get("sglang_flags"),
            "recommendation": sweep.get("recommendation"),
            "sweep": [{k: r.get(k) for k in ("steps", "topk", "num_draft_tokens", "acceptance_length", "speedup",
                                             "speedup_low", "speedup_high")}
                      for r in sweep["configs"]], "sweep_prompts": f"{sweep['num_prompts']} {sweep['prompts']}"}


def _vllm(out: Path) -> dict | None:
    ev = _optional_json(out / "eval_vllm" / "eagle3_evaluation_vllm.json")
    if not ev:
        return None
    return {k: ev.get(k) for k in ("acceptance_length", "acceptance_length_as_evaluate_counts",
                                   "per_position_acceptance", "speedup", "lossless", "vllm_version")}


def _llamacpp(out: Path) -> dict | None:
    ev = _optional_json(out / "eval_llamacpp" / "eagle3_evaluation_llamacpp.json")
    if not ev:
        return None
    return {k: ev.get(k) for k in ("acceptance_length", "acceptance_length_as_evaluate_counts", "speedup",
                                   "speedup_interval", "lossless", "llamacpp_version", "spec_draft_p_min")}


def as_markdown(s: dict) -> str:
    fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    rows = [
        ("data", f"{s['samples']} samples, {s['tokens']:,} tokens; trained on {s['train_samples']} samples, "
                 f"{s['train_tokens']:,} tokens (the rest is the validation split)"),
        ("features on disk", f"{s['feature_bytes'] / 2**20:.1f} MiB ({s['bytes_per_token']} B/token; "
                             f"4 x hidden x 2 = {s['reference_bytes_per_token']} + ids, mask, greedy)"),
        ("checkpoint (standard layout)", f"{s['checkpoint_bytes'] / 2**20:.1f} MiB"),
        ("stage times (s; evaluate beside sweep + evaluate_tree)",
         ", ".join(f"{k} {v}" for k, v in s["seconds"].items())),
        ("total wall time", f"{s['total_seconds']} s" if s["total_seconds"] else "n/a"),
        ("step accuracy (validation)", fmt(s["step_accuracy"])),
        ("conditional accuracy", fmt(s["step_conditional_accuracy"])),
        ("simulated τ", f"{s['simulated_acceptance_length']:.3f}"),
        ("τ (real speculative decoding)", f"{s['acceptance_length']:.3f}  ({s['eval']['engine']}, chain, "
                                           f"k={s['eval']['k']}, T={s['eval']['temperature']}, "
                                           f"{s['eval']['num_prompts']} {s['eval']['prompts']} prompts)"),
        ("per-position acceptance", fmt(s["per_position_acceptance"])),
        ("speedup vs greedy decoding", f"{s['speedup']:.2f}x (same machine)"),
        ("lossless", str(s["lossless"])),
    ]
    tree = s.get("tree")
    if tree:
        sweep = "; ".join(f"S{r['steps']} K{r['topk']} N{r['num_draft_tokens']}: τ {r['acceptance_length']:.2f}, "
                          f"{r['speedup']:.2f}x [{r['speedup_low']:.2f}, {r['speedup_high']:.2f}]"
                          for r in tree["sweep"])
        rec = tree["recommendation"]
        rows += [
            ("tree sweep (dev prompts)", f"{sweep} ({tree['sweep_prompts']} prompts)"),
            ("recommended (sweep)", f"S={rec['steps']} K={rec['topk']} N={rec['num_draft_tokens']}: {rec['reason']}"),
            ("τ, sweep's first tree", f"{tree['acceptance_length']:.3f}  (S={tree['steps']} K={tree['topk']} "
                                      f"N={tree['num_draft_tokens']}, same {s['eval']['num_prompts']} prompts as the "
                                      "chain)"),
            ("speedup, that tree", f"{tree['speedup']:.2f}x, lossless {tree['lossless']}"),
        ]
    served = s.get("vllm")
    if served and served["acceptance_length"] is not None:
        gap = served["acceptance_length_as_evaluate_counts"] - s["acceptance_length"]
        rows += [
            ("τ served by vLLM", f"{served['acceptance_length']:.3f}  (vLLM {served['vllm_version']}, chain k=3; "
                                  f"counted as evaluate counts: {served['acceptance_length_as_evaluate_counts']:.3f}, "
                                  f"{gap:+.3f} against transformers)"),
            ("vLLM speedup, lossless",
             f"{served['speedup']:.2f}x over plain vLLM, token-identical {served['lossless']}"),
        ]
    cpp = s.get("llamacpp")
    if cpp and cpp["acceptance_length"] is not None:
        low, high = cpp.get("speedup_interval") or [float("nan"), float("nan")]
        rows += [
            ("τ served by llama.cpp", f"{cpp['acceptance_length']:.3f}  (llama-server {cpp['llamacpp_version']}, "
                                       f"draft-eagle3 k=3, p-min {cpp['spec_draft_p_min']:g}, the embedded Q4_1 GGUF; "
                                       "counted as evaluate counts: "
                                       f"{cpp['acceptance_length_as_evaluate_counts']:.3f})"),
            ("llama.cpp speedup, lossless", f"{cpp['speedup']:.2f}x [{low:.2f}, {high:.2f}] over plain llama-server, "
                                             f"token-identical {cpp['lossless']}"),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["| what | value |", "|---|---|"] + [f"| {k:<{width}} | {v} |" for k, v in rows])


def machine() -> str:
    """The CPU the demo ran on, as the results page records it: model, cores, AVX-512 or not."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.+)", cpuinfo).group(1).strip()  # type: ignore[union-attr]
        flags = re.search(r"flags\s*:\s*(.+)", cpuinfo).group(1)  # type: ignore[union-attr]
    except (OSError, AttributeError):
        pass
    simd = "AVX-512" if "avx512f" in flags.split() else "AVX2, no AVX-512" if "avx2" in flags.split() else "?"
    return f"{model}, {os.cpu_count()} cores ({simd}), {platform.system()}"


MEASURED = ("eagle3_hf", "examples", "Makefile")  # the code `make demo` runs


def commit() -> str:
    """The last commit that changed the code the demo runs (a later docs-only HEAD measured the same code):
    tests/test_results_pages.py requires the page's commit to touch it."""
    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    code = git("log", "-1", "--format=%h", "HEAD", "--", *MEASURED) or "unknown"
    later = code != "unknown" and code != git("rev-parse", "--short", "HEAD")
    at = " (the code measured: the checkout run changed only other files after it)" if later else ""
    return code + at + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def results_page(table: str, size: str) -> str:
    command = "make demo" if size == "small" else f"DEMO_SIZE={size} make demo"
    return "\n".join([
        f"# The demo ({size})", "",
        f"Written by `python examples/demo_summary.py demo_out/{size} --results docs/results/demo.md`, which "
        f"`{command}` runs as its last stage; do not edit it by hand.", "",
        f"- command: `{command}` (examples/demo.sh; the recipe: examples/recipes/small_cpu.yaml)",
        f"- commit: {commit()}",
        f"- machine: {machine()}",
        f"- date: {datetime.date.today().isoformat()}", "",
        BEGIN, table, END, ""])


def embed(readme: Path, table: str) -> None:
    """Replace the table between the demo-table markers in README.md (the markers must be there)."""
    text = readme.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:start] + "\n" + table + "\n" + text[end:], encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=int, default=None,
                        help="the demo's wall time (default: the one an earlier summary.json in OUT recorded)")
    parser.add_argument("--results", type=Path, default=None,
                        help="also write this results page (docs/results/demo.md) and README.md's demo table")
    args = parser.parse_args()
    seconds = args.seconds
    if seconds is None and (args.out / "summary.json").is_file():
        seconds = json.loads((args.out / "summary.json").read_text()).get("total_seconds")
    summary = summarize(args.out, seconds)
    table = as_markdown(summary)
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(table)
    if args.results:
        args.results.write_text(results_page(table, args.out.name), encoding="utf-8")
        embed(ROOT / "README.md", table)
        print(f"wrote {args.results} and README.md's demo table")


if __name__ == "__main__":
    main()
