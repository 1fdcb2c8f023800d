"""What an acceptance loss (`--objective lk-hybrid | lk-alpha`) costs over `kl` in the part of the step that differs:
the teacher (with the verifier's mass outside the draft vocabulary: its other head rows, a block at a time) and the
TTT loss's forward and backward over three steps, at the SmolLM2 bench shape (train_step.py's `smollm2`).

Times alternate the objectives in one process (best of `--repeats`); the peak memory of one teacher + loss + backward
above what was resident before it is each objective's own subprocess (RSS high-water mark, as step_timing.py reads
it), beside the resident head rows the LK objectives keep.

    .venv/bin/python -m bench.objective_cost [--tokens 1500] [--vocab 49152] [--draft-vocab 8192] [--hidden 576]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from bench.step_timing import rss_mib

OBJECTIVES = ("kl", "lk-hybrid", "lk-alpha")


def setup(args: argparse.Namespace, objective: str):
    from eagle3_hf import Eagle3Config, Eagle3DraftModel
    from eagle3_hf.model.checkpoint import vocab_from_target_ids

    torch.manual_seed(0)
    config = Eagle3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=64, num_attention_heads=1,
                          num_key_value_heads=1, head_dim=args.hidden, draft_vocab_size=args.draft_vocab,
                          target_hidden_size=args.hidden)
    model = Eagle3DraftModel(config)
    model.set_vocab_mapping(*vocab_from_target_ids(torch.arange(0, 2 * args.draft_vocab, 2), args.vocab))
    model.attach_teacher(torch.randn(args.vocab, args.hidden) * 0.05, in_vocab_mass=objective != "kl")
    hidden = torch.randn(args.tokens, args.hidden)
    logits = [torch.randn(args.tokens, args.draft_vocab, requires_grad=True) for _ in range(3)]
    return model, hidden, logits


def step(model, hidden: torch.Tensor, logits: list[torch.Tensor], objective: str) -> tuple[float, float]:
    """(teacher seconds, loss forward + backward seconds) of one batch, three TTT steps sharing the teacher."""
    from eagle3_hf.train.loss import acceptance_objective
    from eagle3_hf.train.objective import Objective

    rows = torch.arange(hidden.shape[0])
    t0 = time.perf_counter()
    if objective == "kl":
        probs, mass = model.teacher_distribution(hidden), None
    else:
        probs, mass = model.teacher_distribution_and_mass(hidden)
    t1 = time.perf_counter()
    total = sum(0.8**i * acceptance_objective(z, probs, rows, rows, mass, Objective(objective))[0]
                for i, z in enumerate(logits))
    total.backward()
    return t1 - t0, time.perf_counter() - t1


def memory_worker(args: argparse.Namespace) -> None:
    model, hidden, logits = setup(args, args.memory_worker)
    step(model, hidden, logits, args.memory_worker)  # first calls' allocations
    for z in logits:
        z.grad = None
    before = rss_mib("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here on
    step(model, hidden, logits, args.memory_worker)
    rest = model.verifier_lm_head_rest
    print(json.dumps({"peak_above_resident_mib": rss_mib("VmHWM") - before,
                      "other_head_rows_mib": 0.0 if rest is None else rest.weight.numel() * 4 / 2**20}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1500, help="loss positions of the batch (teacher rows)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory-worker", choices=OBJECTIVES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_worker:
        memory_worker(args)
        return
    setups = {o: setup(args, o) for o in OBJECTIVES}
    best = {o: [float("inf"), float("inf")] for o in OBJECTIVES}
    for r in range(args.repeats):
        for o in OBJECTIVES if r % 2 == 0 else OBJECTIVES[::-1]:
            teacher, loss = step(*setups[o], o)
            best[o] = [min(best[o][0], teacher), min(best[o][1], loss)]
    del setups
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("memory_worker", "repeats")]
    out: dict = {"shape": {k: v for k, v in vars(args).items() if k != "memory_worker"}}
    for o in OBJECTIVES:
        done = subprocess.run([sys.executable, "-m", "bench.objective_cost", *flags, f"--memory-worker={o}"],
                              capture_output=True, text=True, check=True)
        teacher, loss = best[o]
        out[o] = {"teacher_s": teacher, "loss_s": loss, **json.loads(done.stdout.strip().splitlines()[-1])}
        if o != "kl":
            kl = best["kl"]
            out[o].update({"teacher_over_kl": teacher / kl[0], "loss_over_kl": loss / kl[1],
                           "teacher_plus_loss_over_kl": (teacher + loss) / sum(kl),
                           "extra_s_per_batch": teacher + loss - sum(kl)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
