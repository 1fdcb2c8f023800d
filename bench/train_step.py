"""Training-step benchmark: tokens/s, peak memory and MFU of one drafter step, ours beside speculators 0.9.0.

One step = forward with the TTT unroll (3 steps) + loss + backward + clip_grad_norm + AdamW step, fp32 on
CPU, batch 1 row, for three drafters:

- `smollm2`: hidden 576 (9 heads x 64, 3 KV heads, intermediate 1536), verifier vocab 49152, draft vocab
  8192, 2048-token rows;
- `h1024`: hidden 1024 (8 heads x 128, 8 KV heads, intermediate 2816: what `Eagle3Config.from_verifier`
  picks for a hidden-1024 verifier), verifier vocab 128256, draft vocab 32000, 1024-token rows;
- `h2048`: hidden 2048 (16 heads x 128, 8 KV heads, intermediate 8192, as for a Llama-3.2-1B verifier),
  verifier vocab 128256, draft vocab 32000, 512-token rows: the step toward hidden 7168 that fits here;

each on `packed` rows (documents of 100-700 tokens back to back) and `padded` rows (the same documents, one
per row padded to the row length, gradients accumulated over the rows, one optimizer step). Tokens/s counts
real tokens only. Ours is the step `Eagle3Trainer` runs (`drafter_loss`, step metrics, fused AdamW); speculators
is its own `Eagle3DraftModel` forward (TTT unroll, eager KL loss and metrics), backward, clip and AdamW from
its `build_optimizers` (bench/speculators_step.py, run by `.bench-venv/speculators/bin/python`), on the same
rows. Every measurement is a fresh subprocess (so peak memory is comparable); the two alternate, the packed
layout over `--rounds` rounds, and medians are reported. An fp32 2048^3 matmul is timed between runs: MFU =
model FLOPs of the step / step time / that matmul's FLOP/s, with the same thread count.

    .venv/bin/python -m bench.train_step --setup-speculators     # once: builds .bench-venv/speculators
    .venv/bin/python -m bench.train_step                         # ~10 min on 2 shared cores
    .venv/bin/python -m bench.train_step --quick                 # smollm2 packed only, ~1 min
    .venv/bin/python -m bench.train_step --configs h1024 --layouts packed --rounds 3 --threads 2 --profile 25

Model FLOPs per real token: 6 x params of every trained linear layer it passes (fc once; q/k/v/o, MLP and
lm_head once per TTT step; 4 x instead of 6 x for a frozen lm_head, whose input gradient is still needed),
12 x heads x head_dim per (query, key) pair the mask allows (causal within the document plus the i diagonal
keys at step i), and the teacher head forward 2 x draft_vocab x hidden. Both heads are counted at every
real token, as speculators computes them; ours computes lm_head only where the loss or the metrics read it
and the teacher only where the loss reads it (no prompt tokens, no document tails). The projects' default
recipes differ: speculators keeps `lm_head` frozen (the verifier's rows), ours trains it by default, so
two rows of ours are timed: `ours` (trained lm_head) and `ours-frozen-head` (`--init-lm-head verifier
--freeze-lm-head`, the like-for-like row). `--objectives kl,lk-hybrid` adds a row of ours per acceptance loss
(`ours-lk-hybrid`: `--objective lk-hybrid`, the verifier's whole head kept for the teacher's in-vocabulary mass)
and prints its step time and peak memory over the `ours` (kl) row's, the two alternating in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle3_hf import Eagle3Config

from bench.step_timing import measure_steps, rss_mib

REPO = Path(__file__).resolve().parent.parent
# EAGLE3_HF_SPECULATORS_VENV moves it (`make speculators` builds it outside the clone, cached, for the tests)
SPEC_VENV = Path(os.environ.get("EAGLE3_HF_SPECULATORS_VENV") or REPO / ".bench-venv" / "speculators")
SPEC_PYTHON = SPEC_VENV / "bin" / "python"
SPEC_PIN = "speculators==0.9.0"
SPEC_STAMP = SPEC_VENV / ".eagle3_hf_speculators"  # holds what was installed: a second setup with it is instant
SPEC_DRIVER = "bench.speculators_step"  # run as a module by the speculators venv, with the repository on PYTHONPATH

CONFIGS = {
    "smollm2": dict(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                    vocab_size=49152, draft_vocab_size=8192, row_len=2048),
    "h1024": dict(hidden_size=1024, num_heads=8, num_kv_heads=8, head_dim=128, intermediate_size=2816,
                  vocab_size=128256, draft_vocab_size=32000, row_len=1024),
    "h2048": dict(hidden_size=2048, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=8192,
                  vocab_size=128256, draft_vocab_size=32000, row_len=512),
}
DOC_MIN, DOC_MAX = 100, 700
TTT_STEPS, STEP_WEIGHT = Eagle3Config.ttt_steps, Eagle3Config.ttt_step_weight  # the Trainer's defaults

# what `--setup-speculators` installs beside torch and `--no-deps speculators==0.9.0`: the runtime
# dependencies its model, loss and optimizer imports pull in (from its metadata); no torchvision/torchaudio
SPEC_DEPS = ["transformers>=5.0.0,<=5.19.0", "numpy>=2.0.0,<=2.5.4", "pydantic>=2.0.0", "pydantic-settings",
             "loguru>=0.7.2,<=0.7.3", "psutil", "safetensors", "huggingface-hub", "tqdm>=4.66.3,<=4.70.1",
             "openai>=2.0.0", "datasets>=4.0.0,<=5.1.0", "hs-connectors==0.9.0"]


# ---------------------------------------------------------------------------------------------- setup


def setup_speculators() -> None:
    """Create SPEC_VENV: torch (TORCH_SPEC, default the CPU 2.13.0, found as scripts/torch_index.py finds it),
    speculators 0.9.0 --no-deps, its deps. Once: the stamp records the set, so a second run costs nothing."""
    torch_spec = os.environ.get("TORCH_SPEC") or "torch==2.13.0+cpu"
    want = " ".join([torch_spec, SPEC_PIN, *SPEC_DEPS])
    if SPEC_STAMP.is_file() and SPEC_STAMP.read_text() == want:
        print(f"speculators ({SPEC_PIN}) already installed in {SPEC_VENV}")
        return
    start = time.time()
    if not SPEC_PYTHON.exists():
        subprocess.run([sys.executable, "-m", "venv", str(SPEC_VENV)], check=True)
    pip = [str(SPEC_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    index = subprocess.run([str(SPEC_PYTHON), str(REPO / "scripts" / "torch_index.py"), torch_spec],
                           capture_output=True, text=True, check=True).stdout.split()
    subprocess.run(pip + [torch_spec, *index], check=True)
    subprocess.run(pip + ["--no-deps", SPEC_PIN], check=True)
    subprocess.run(pip + SPEC_DEPS, check=True)
    probe = ("import speculators.models.eagle3, speculators.losses, speculators.train.optimizers, torch; "
             "print('speculators ready, torch', torch.__version__)")
    subprocess.run([str(SPEC_PYTHON), "-c", probe], check=True)
    SPEC_STAMP.write_text(want)
    print(f"speculators installed in {SPEC_VENV} in {time.time() - start:.0f} s")


def speculators_available() -> str | None:
    """None when the comparison can run, else why not."""
    if not SPEC_PYTHON.exists():
        return (f"{SPEC_VENV} is absent: run `make speculators` or `bench/train_step.py --setup-speculators` "
                "to add the speculators 0.9.0 comparison")
    probe = subprocess.run([str(SPEC_PYTHON), "-c", "import speculators.models.eagle3"], capture_output=True)
    if probe.returncode:
        return f"{SPEC_VENV} cannot import speculators; rerun `make speculators` (or --setup-speculators)"
    return None


# ---------------------------------------------------------------------------------------------- data


def document_lengths(row_len: int, rng: random.Random) -> list[int]:
    """Documents of DOC_MIN..DOC_MAX tokens packed into one row; a tail shorter than DOC_MIN stays padding."""
    lengths, left = [], row_len
    while left >= DOC_MIN:
        n = min(rng.randint(DOC_MIN, DOC_MAX), left)
        lengths.append(n)
        left -= n
    return lengths


def make_rows(cfg: dict, lengths: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """The packed row [1, L] and the same documents padded one per row [n_docs, L], plus d2t / t2d."""
    g = torch.Generator().manual_seed(seed)
    hidden, vocab, draft, row_len = cfg["hidden_size"], cfg["vocab_size"], cfg["draft_vocab_size"], cfg["row_len"]
    kept = torch.randperm(vocab, generator=g)[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    d2t = kept - torch.arange(draft)
    total = sum(lengths)
    ids = torch.randint(0, vocab, (total,), generator=g)
    aux = torch.randn(total, 3 * hidden, generator=g)
    last = torch.randn(total, hidden, generator=g)
    # the verifier's greedy token: mostly inside the draft vocabulary
    greedy = torch.where(torch.rand(total, generator=g) < 0.9, kept[torch.randint(0, draft, (total,), generator=g)],
                         torch.randint(0, vocab, (total,), generator=g))
    out: dict[str, torch.Tensor] = {"d2t": d2t, "t2d": t2d}
    for layout, n_rows in (("", 1), ("padded.", len(lengths))):
        rows = {
            "input_ids": torch.zeros(n_rows, row_len, dtype=torch.long),
            "aux_hidden_states": torch.zeros(n_rows, row_len, 3 * hidden),
            "last_hidden_state": torch.zeros(n_rows, row_len, hidden),
            "verifier_greedy": torch.zeros(n_rows, row_len, dtype=torch.long),
            "document_ids": torch.full((n_rows, row_len), -1, dtype=torch.long),
            "position_ids": torch.zeros(n_rows, row_len, dtype=torch.long),
            "loss_mask": torch.zeros(n_rows, row_len, dtype=torch.long),
        }
        src, col = 0, 0
        for d, n in enumerate(lengths):
            r = d if layout else 0
            c = 0 if layout else col
            sl, dst = slice(src, src + n), (r, slice(c, c + n))
            rows["input_ids"][dst] = ids[sl]
            rows["aux_hidden_states"][dst] = aux[sl]
            rows["last_hidden_state"][dst] = last[sl]
            rows["verifier_greedy"][dst] = greedy[sl]
            rows["document_ids"][dst] = 0 if layout else d
            rows["position_ids"][dst] = torch.arange(n)
            rows["loss_mask"][dst] = (torch.arange(n) >= n // 4).long()  # a prompt quarter carries no loss
            src, col = src + n, col + n
        out.update({layout + k: v for k, v in rows.items()})
    return out


# ---------------------------------------------------------------------------------------------- FLOPs


def model_flops(cfg: dict, lengths: list[int], steps: int, lm_head_trainable: bool) -> float:
    """Model FLOPs of one training step over the real tokens (see the module docstring)."""
    h, nh, nkv, hd, inter = (cfg[k] for k in ("hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                               "intermediate_size"))
    vd = cfg["draft_vocab_size"]
    tokens = sum(lengths)
    fc = 3 * h * h
    layer = 2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter
    per_token = 6 * fc + steps * (6 * layer + (6 if lm_head_trainable else 4) * vd * h) + 2 * vd * h
    pairs = sum(steps * n * (n + 1) // 2 + n * sum(range(steps)) for n in lengths)
    return tokens * per_token + 12 * nh * hd * pairs


def matmul_flops(n: int = 2048, repeats: int = 6) -> float:
    """Best-of-`repeats` FLOP/s of an fp32 n x n @ n x n matmul with this process's threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


# ---------------------------------------------------------------------------------------------- our step


def run_ours(spec: dict, batch_path: str) -> dict:
    """Our Eagle3DraftModel step as Eagle3Trainer runs it (compute_loss, metrics, clip, fused AdamW)."""
    from safetensors.torch import load_file

    from eagle3_hf import Eagle3Config, Eagle3DraftModel
    from eagle3_hf.train.loss import drafter_loss
    from eagle3_hf.train.metrics import StepStats
    from eagle3_hf.train.objective import Objective
    from eagle3_hf.train.targets import PLAN_KEY, plan_batches

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    rss_imports = rss_mib("VmRSS")
    m = spec["model"]
    data = load_file(batch_path)
    config = Eagle3Config(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
        num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"], head_dim=m["head_dim"],
        max_position_embeddings=m["max_position_embeddings"], rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, draft_vocab_size=m["draft_vocab_size"],
        target_hidden_size=m["hidden_size"], aux_hidden_state_indices=[2, 15, 27], ttt_steps=spec["ttt_steps"],
        ttt_step_weight=spec["step_weight"],
    )
    config._attn_implementation = spec["attn"]
    model = Eagle3DraftModel(config)
    model.packed_attention = spec.get("packed_attention", "auto")
    model.set_vocab_mapping(data["d2t"], data["t2d"])
    embed = torch.randn(m["vocab_size"], m["hidden_size"], generator=torch.Generator().manual_seed(1)) * 0.02
    model.load_verifier_embeddings(embed)
    del embed
    # the verifier's lm_head [V, H]; with kl only the draft rows are ever read (as the trainer reads only those
    # shards), so the untouched rows of this empty tensor never become resident; an acceptance loss keeps them all
    objective = Objective(spec.get("objective", "kl"))
    head = torch.empty(m["vocab_size"], m["hidden_size"])
    if objective.needs_in_vocab_mass:
        head.copy_(torch.randn(m["vocab_size"], m["hidden_size"], generator=torch.Generator().manual_seed(3)) * 0.02)
    head[data["t2d"]] = torch.randn(m["draft_vocab_size"], m["hidden_size"],
                                    generator=torch.Generator().manual_seed(2)) * 0.02
    model.attach_teacher(head, in_vocab_mass=objective.needs_in_vocab_mass)
    del head
    if spec.get("frozen_lm_head"):  # --init-lm-head verifier --freeze-lm-head, as speculators trains
        model.init_lm_head_from_verifier()
        model.freeze_lm_head()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=True)  # the Trainer's default
    prefix = "padded." if spec["layout"] == "padded" else ""  # the packed row has no prefix
    names = ("input_ids", "aux_hidden_states", "last_hidden_state", "verifier_greedy", "document_ids", "position_ids",
             "loss_mask")
    rows = {k: data[prefix + k] for k in names}
    num_rows = rows["input_ids"].shape[0]
    real_tokens = int((rows["document_ids"] != -1).sum())
    stats = StepStats(spec["ttt_steps"])

    def step(batches: list[dict]) -> None:
        plans = plan_batches(batches, spec["ttt_steps"], model.t2d)  # Eagle3Trainer._get_num_items_in_batch
        items = torch.tensor(sum(p.loss_counts[0] for p in plans))  # num_items_in_batch
        optimizer.zero_grad(set_to_none=True)
        for b, plan in zip(batches, plans):
            b = {**b, PLAN_KEY: plan}
            loss = drafter_loss(model, b, model.t2d, spec["ttt_steps"], spec["step_weight"], objective=objective)
            stats.update(loss.outputs.logits, b, model.d2t, model.t2d, loss.step_losses, logits_mask=loss.logits_mask,
                         head_rows=loss.head_rows, step_alphas=loss.step_alphas)
            loss.normalised(items).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()

    times, peak_step, profile = measure_steps(step, rows, spec)
    return {
        "impl": "ours", "times": times, "real_tokens": real_tokens, "rows": num_rows,
        "peak_step_mib": peak_step, "rss_imports_mib": rss_imports, "profile": profile,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trainable_params": sum(p.numel() for p in trainable),
        "lm_head_trainable": bool(model.lm_head.weight.requires_grad),
    }


# ---------------------------------------------------------------------------------------------- driver


def run_worker(impl: str, spec: dict, batch_path: str, workdir: str) -> dict:
    spec_path = os.path.join(workdir, "spec.json")
    out_path = os.path.join(workdir, "result.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    if impl == "speculators":
        cmd = [str(SPEC_PYTHON), "-m", SPEC_DRIVER]
    else:
        cmd = [sys.executable, "-m", "bench.train_step", "--worker"]
    cmd += ["--spec", spec_path, "--batch", batch_path, "--out", out_path]
    env = dict(os.environ, PYTHONPATH=str(REPO),
               TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode or not os.path.exists(out_path):
        raise RuntimeError(f"{impl} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out_path, encoding="utf-8") as f:
        return json.load(f)


def _median_step(runs: list[dict]) -> float:
    return statistics.median([t for r in runs for t in r["times"]])


def _best_step(runs: list[dict]) -> float:
    return min(t for r in runs for t in r["times"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="smollm2,h1024", help=f"comma-separated, from {sorted(CONFIGS)}")
    parser.add_argument("--layouts", default="packed,padded")
    parser.add_argument("--rounds", type=int, default=2,
                        help="alternating rounds (ours, speculators / speculators, ours, ...) of the packed layout")
    parser.add_argument("--padded-rounds", type=int, default=1, help="rounds of the padded layout (n_docs x dearer)")
    parser.add_argument("--steps", type=int, default=2, help="timed packed steps per run (padded: 1)")
    parser.add_argument("--warmup-tokens", type=int, default=256,
                        help="the untimed warm-up step (AdamW state, first calls) runs on this many columns of a row")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--packed-attention", default="auto", choices=["auto", "row", "document"],
                        help="ours: one attention call per TTT step over the row, or one per document (auto: "
                             "document on the CPU, as the Trainer)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of every run and of the matmul bound (default 1: on a shared machine a "
                             "co-tenant stalls a 2-thread run at every barrier, 1 thread only slows it down)")
    parser.add_argument("--quick", action="store_true", help="smollm2 packed only, one round of one step")
    parser.add_argument("--no-speculators", action="store_true")
    parser.add_argument("--no-frozen-lm-head", action="store_true",
                        help="skip the row of ours with lm_head frozen (the like-for-like row: speculators freezes it)")
    parser.add_argument("--objectives", default="kl",
                        help="comma-separated --objective values; each besides kl adds a row of ours (ours-NAME) and "
                             "its step time and peak memory over ours'")
    parser.add_argument("--setup-speculators", action="store_true", help=f"create {SPEC_VENV} and exit")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed steps, profile one more step per run and print its top N ops")
    parser.add_argument("--json", default=None, help="also write all results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--batch", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        with open(args.spec, encoding="utf-8") as f:
            result = run_ours(json.load(f), args.batch)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f)
        return
    if args.setup_speculators:
        setup_speculators()
        return

    torch.set_num_threads(args.threads)  # the matmul bound is measured with the workers' thread count
    if args.quick:
        args.configs, args.layouts, args.rounds, args.padded_rounds, args.steps = "smollm2", "packed", 1, 0, 1
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [c for c in configs if c not in CONFIGS] + [x for x in layouts if x not in ("packed", "padded")]
    if unknown:
        parser.error(f"unknown config or layout: {unknown}")
    from eagle3_hf.train.objective import OBJECTIVES

    objectives = [o.strip() for o in args.objectives.split(",") if o.strip() and o.strip() != "kl"]
    if any(o not in OBJECTIVES for o in objectives):
        parser.error(f"--objectives: each one of {OBJECTIVES}")
    impls = ["ours"] + [f"ours-{o}" for o in objectives] + ([] if args.no_frozen_lm_head else ["ours-frozen-head"])
    skip_note = "--no-speculators" if args.no_speculators else speculators_available()
    if skip_note is None:
        impls.append("speculators")
    else:
        print(f"note: speculators comparison skipped: {skip_note}")

    from safetensors.torch import save_file

    started = time.perf_counter()
    results: dict[tuple, list[dict]] = {}
    peaks: list[float] = []
    with tempfile.TemporaryDirectory(prefix="train_step_bench_") as workdir:
        batches, lengths_of = {}, {}
        for name in configs:
            cfg = CONFIGS[name]
            lengths = document_lengths(cfg["row_len"], random.Random(f"{name}-docs"))
            lengths_of[name] = lengths
            batches[name] = os.path.join(workdir, f"{name}.safetensors")
            save_file({k: v.contiguous() for k, v in make_rows(cfg, lengths).items()}, batches[name])
            print(f"{name}: row {cfg['row_len']}, documents {lengths} ({sum(lengths)} real tokens; padded: "
                  f"{len(lengths)} rows)")
        peaks.append(matmul_flops())
        for rnd in range(max(args.rounds, args.padded_rounds)):
            order = impls if rnd % 2 == 0 else impls[::-1]
            for name in configs:
                for layout in layouts:
                    if rnd >= (args.rounds if layout == "packed" else args.padded_rounds):
                        continue
                    for impl in order:
                        spec = {"model": dict(CONFIGS[name], max_position_embeddings=4096), "layout": layout,
                                "attn": args.attn, "packed_attention": args.packed_attention,
                                "ttt_steps": TTT_STEPS, "step_weight": STEP_WEIGHT,
                                "threads": args.threads, "steps": args.steps if layout == "packed" else 1,
                                "warmup": 1, "warmup_tokens": args.warmup_tokens,
                                "frozen_lm_head": impl == "ours-frozen-head", "profile": args.profile,
                                "objective": impl[len("ours-"):] if impl[len("ours-"):] in objectives else "kl"}
                        res = run_worker("speculators" if impl == "speculators" else "ours", spec, batches[name],
                                         workdir)
                        results.setdefault((name, layout, impl), []).append(res)
                        print(f"  round {rnd + 1} {name:8s} {layout:6s} {impl:17s} "
                              f"{res['real_tokens'] / statistics.median(res['times']):8.1f} tok/s  "
                              f"step peak {res['peak_step_mib']:6.0f} MiB", flush=True)
                        if res.get("profile") and rnd == 0:
                            print(res["profile"])
                        peaks.append(matmul_flops())

    peak = statistics.median(peaks)
    print(f"\nfp32 matmul 2048^3 with {args.threads} thread(s): median {peak / 1e9:.1f} GFLOP/s over {len(peaks)} "
          f"measurements (min {min(peaks) / 1e9:.1f}, max {max(peaks) / 1e9:.1f}); attention {args.attn}; "
          f"{time.perf_counter() - started:.0f} s in all")
    header = (f"{'config':8s} {'layout':6s} {'impl':17s} {'tok/s':>7s} {'best':>7s} {'step s':>7s} {'peak MiB':>8s} "
              f"{'GFLOP':>6s} {'MFU':>6s} {'ours/spec':>9s} {'best':>5s} {'mem o/s':>7s}")
    print(header)
    print("-" * len(header))
    table = []
    for name in configs:
        for layout in layouts:
            spec_runs = results.get((name, layout, "speculators"))
            for impl in impls:
                runs = results.get((name, layout, impl))
                if not runs:
                    continue
                tokens = runs[0]["real_tokens"]
                step_s, best_s = _median_step(runs), _best_step(runs)
                mem = statistics.median([r["peak_step_mib"] for r in runs])
                flops = model_flops(CONFIGS[name], lengths_of[name], TTT_STEPS, runs[0]["lm_head_trainable"])
                row = {"config": name, "layout": layout, "impl": impl, "tokens_per_s": tokens / step_s,
                       "best_tokens_per_s": tokens / best_s, "step_s": step_s, "peak_step_mib": mem,
                       "ru_maxrss_mib": statistics.median([r["ru_maxrss_mib"] for r in runs]),
                       "model_flops": flops, "mfu": flops / step_s / peak, "runs": runs}
                ratio = best = mem_ratio = ""
                if spec_runs and impl != "speculators":
                    row["ours_over_speculators"] = _median_step(spec_runs) / step_s
                    row["ours_over_speculators_best"] = _best_step(spec_runs) / best_s
                    row["memory_ours_over_speculators"] = mem / statistics.median(
                        [r["peak_step_mib"] for r in spec_runs])
                    ratio = f"{row['ours_over_speculators']:.2f}x"
                    best = f"{row['ours_over_speculators_best']:.2f}"
                    mem_ratio = f"{row['memory_ours_over_speculators']:.2f}"
                print(f"{name:8s} {layout:6s} {impl:17s} {tokens / step_s:7.1f} {tokens / best_s:7.1f} {step_s:7.2f} "
                      f"{mem:8.0f} {flops / 1e9:6.0f} {row['mfu']:6.1%} {ratio:>9s} {best:>5s} {mem_ratio:>7s}")
                table.append(row)
    for name in configs:
        for layout in layouts:
            kl_runs = results.get((name, layout, "ours"))
            for o in objectives:
                runs = results.get((name, layout, f"ours-{o}"))
                if kl_runs and runs:
                    mem = [statistics.median([r["peak_step_mib"] for r in x]) for x in (runs, kl_runs)]
                    ratios = {"config": name, "layout": layout, "objective": o,
                              "step_time_over_kl": _median_step(runs) / _median_step(kl_runs),
                              "best_step_time_over_kl": _best_step(runs) / _best_step(kl_runs),
                              "peak_memory_over_kl": mem[0] / mem[1], "peak_mib_minus_kl": mem[0] - mem[1]}
                    print(f"{name} {layout} {o} over kl: step time {ratios['step_time_over_kl']:.3f}x (best "
                          f"{ratios['best_step_time_over_kl']:.3f}x), peak memory {ratios['peak_memory_over_kl']:.3f}x "
                          f"({ratios['peak_mib_minus_kl']:+.0f} MiB)")
                    table.append(ratios)
    print("tok/s: real tokens / median step time (best: fastest step); peak MiB: process RSS high-water mark over "
          "the timed steps; GFLOP: model FLOPs of the step; MFU: GFLOP / step time / matmul bound; ours/spec: "
          "tokens/s ratio (median, best); mem o/s: peak memory ratio")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"matmul_flops": peaks, "attn": args.attn, "threads": args.threads, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
