"""One-GPU acceptance run: the real Eagle3Trainer's step at the recipes' drafter shapes, bf16 training against fp32,
a tiny extraction + speculative decoding, the greedy head, the loader and the hashing rate, on the device. Run
through `gpu_check/gpu_check.sh`; writes one JSON ($OUT/gpu_check.json when $OUT is set), after every part.

Parts, required first (each in its module):
1. `train_step` (train_step.py), per drafter shape, sdpa: one 2048-token packed row (4 documents) through
   `Eagle3Trainer` (plans and loss tokens, `training_step`, clip 0.5, fused AdamW, scheduler), bf16 autocast on a
   GPU, the row attention path: tokens/s, MFU, peak memory beside the plan's, host syncs per micro-step
   - `llama31_8b`: hidden 4096, 32 x 128 heads, 8 KV heads, intermediate 14336, draft vocabulary 32 000, TTT 7;
   - `kimi_k25`: hidden 7168, 56 x 128 heads, 8 KV heads, intermediate 18432, draft vocabulary 32 000, TTT 3.
2. `bf16_gate` (bf16_gate.py), per shape: after a few optimizer steps, bf16 training's per-TTT-step logits moved
   as fp32 training's did.
3. `extract_speculative` (extract_spec.py): features captured and written on the device, a drafter trained on
   them, speculative decoding token-identical to greedy decoding.
4. `greedy_head`, `loader`, `hashing` (rates.py).
5. optional, reported apart and never failing the run: `flex_attention`, the train step with PyTorch's
   flex_attention (compiled; no backward on the CPU).

A global deadline (`--deadline-s`, 420 s) stops the run itself before 8 minutes: a part not started by then is
skipped, one running is interrupted, and both are named in the report; gpu_check.sh's `timeout` is the backstop.
`--device cpu --tiny` runs the same code at tiny shapes in seconds (CI). Exit status 0 only when every required
part ran and passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository, not this folder, is where `gpu_check` is found
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from eagle3_hf import Eagle3Config  # noqa: E402

from gpu_check.bf16_gate import bf16_gate  # noqa: E402
from gpu_check.extract_spec import extraction_and_speculative  # noqa: E402
from gpu_check.rates import greedy_head, hashing, loader_rows  # noqa: E402
from gpu_check.train_step import MAX_SYNCS, chip_peak_flops, train_step_check  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
KIMI_TEXT_CONFIG = REPO / "examples/recipes/kimi_k25_text_config.json"
LLAMA_TEXT_CONFIG = REPO / "examples/recipes/llama31_8b_text_config.json"
TINY_TEXT_CONFIG = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 4096}
DEADLINE_S = 420.0  # the whole run, from the start of this process: 7 minutes, inside the 8 it must stay within
MIN_PART_S = 20.0  # a part is not started with less than this left (full shapes; --tiny starts any)


def shapes(tiny: bool) -> list[tuple[str, Eagle3Config, int]]:
    """(name, drafter config, TTT steps) of the acceptance run: the Llama-3.1-8B drafter at 7 TTT steps and the
    Kimi-K2.5 drafter at its recipe's 3; `--tiny`: one tiny drafter at 3 (CI)."""
    if tiny:
        return [("tiny", Eagle3Config.from_verifier(TINY_TEXT_CONFIG, draft_vocab_size=256, ttt_steps=3), 3)]
    out = []
    for name, path, steps in (("llama31_8b", LLAMA_TEXT_CONFIG, 7), ("kimi_k25", KIMI_TEXT_CONFIG, 3)):
        config = Eagle3Config.from_verifier(json.loads(path.read_text()), draft_vocab_size=32000, ttt_steps=steps)
        out.append((name, config, steps))
    return out


class OutOfTime(BaseException):
    """The global deadline passed (a BaseException: a part's own `except Exception` must not swallow it)."""


class Run:
    """The report, and the parts run against the deadline: each part's result or error recorded, the JSON
    rewritten after every part so that a run cut short still leaves what it measured."""

    def __init__(self, out: Path, deadline_s: float, min_part_s: float, report: dict) -> None:
        self.out, self.min_part_s, self.report = out, min_part_s, report
        self.end = time.monotonic() + deadline_s
        self.stopped = False
        self.previous = signal.signal(signal.SIGALRM, self._alarm), signal.getitimer(signal.ITIMER_REAL)
        signal.setitimer(signal.ITIMER_REAL, max(deadline_s, 0.001))

    @staticmethod
    def _alarm(signum: int, frame: object) -> None:
        raise OutOfTime

    def left(self) -> float:
        return self.end - time.monotonic()

    def part(self, name: str, fn: Callable[[], dict], required: bool = True) -> dict | None:
        where = self.report["parts"] if required else self.report["optional"]
        if self.stopped or self.left() < self.min_part_s:
            where[name] = {"skipped": f"deadline: {max(self.left(), 0):.0f} s left"}
            self.save()
            return None
        t0 = time.perf_counter()
        try:
            result = fn()
        except OutOfTime:
            self.stopped = True
            where[name] = {"skipped": f"interrupted at the deadline after {time.perf_counter() - t0:.0f} s"}
            self.save()
            return None
        except Exception as err:  # noqa: BLE001 - one part failing must not hide the others
            traceback.print_exc()
            where[name] = {"error": f"{type(err).__name__}: {err}"}
            self.save()
            return None
        result["seconds"] = time.perf_counter() - t0
        where[name] = result
        self.save()
        return result

    def finish(self) -> None:
        """The deadline's timer off, and whatever SIGALRM did before (a caller's own timer) back."""
        signal.setitimer(signal.ITIMER_REAL, 0)
        handler, (remaining, interval) = self.previous
        signal.signal(signal.SIGALRM, handler)
        if remaining:
            signal.setitimer(signal.ITIMER_REAL, remaining, interval)

    def save(self) -> None:
        self.out.write_text(json.dumps(self.report, indent=1), encoding="utf-8")


def train_passed(row: dict) -> bool:
    return row["loss_finite"] and row["host_syncs_per_micro_step"] <= MAX_SYNCS


def verdict(report: dict, expected: list[str]) -> tuple[bool, list[str]]:
    """ok, and why not: every required part (`expected`) ran and passed (optional ones never count)."""
    failed = [f"{name}: not run (deadline)" for name in expected if name not in report["parts"]]
    for name, result in report["parts"].items():
        if "skipped" in result or "error" in result:
            failed.append(f"{name}: {result.get('skipped') or result.get('error')}")
        elif name.startswith("train_step") and not train_passed(result):
            failed.append(f"{name}: non-finite loss or more than {MAX_SYNCS} host syncs per micro-step")
        elif name.startswith("bf16_gate") and not result["ok"]:
            failed.append(f"{name}: bf16 logits moved {max(result['move_rel_err']):.3f} from fp32's change "
                          f"(< {result['move_rtol']}), forward {max(result['forward_rel_err']):.3f}")
        elif name == "extract_speculative" and not result["lossless_ok"]:
            failed.append(f"{name}: speculative decoding differs from greedy decoding")
        elif name == "greedy_head" and not result["ok"]:
            failed.append(f"{name}: bf16 head agrees with fp32 on {result['bf16_agreement_with_fp32']:.4f}")
    return not failed, failed


def print_row(name: str, row: dict) -> None:
    plan_gib = row.get("plan_total_gib", row["plan_step_peak_gib"])
    peak_gib = row["peak_memory_gib"] if "plan_total_gib" in row else row["step_memory_gib"]
    print(f"{name:28s} {row['tokens_per_s']:9.0f} tok/s {statistics.median(row['step_s']):7.3f} s/step "
          f"MFU {row.get('mfu', float('nan')):6.1%} peak {peak_gib:6.2f} GiB (plan {plan_gib:6.2f}) "
          f"syncs {row['host_syncs_per_micro_step']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the same code in seconds (CI)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per shape")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the chip's dense bf16 peak (default: by name)")
    parser.add_argument("--no-flex", action="store_true", help="skip the optional flex_attention part")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S,
                        help="stop the whole run after this many seconds (default %(default)s)")
    parser.add_argument("--out", default=None,
                        help="the report (default: $OUT/gpu_check.json when $OUT is set, else gpu_check.json)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible (use --device cpu --tiny for the CPU path)")
    import transformers

    started = time.perf_counter()
    row_len, documents = (256, 4) if args.tiny else (2048, 4)
    bf16 = args.device == "cuda"  # the train step as the GPU recipes run it; the bf16 gate runs bf16 everywhere
    peak_flops, peak_note = chip_peak_flops(args.device, args.peak_tflops)
    report: dict = {"device": args.device, "tiny": args.tiny, "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "peak": peak_note,
                    "deadline_s": args.deadline_s,
                    "drafters": {name: {"hidden_size": c.hidden_size, "heads": c.num_attention_heads,
                                        "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                                        "intermediate_size": c.intermediate_size, "ttt_steps": steps,
                                        "draft_vocab_size": c.draft_vocab_size, "vocab_size": c.vocab_size}
                                 for name, c, steps in shapes(args.tiny)},
                    "parts": {}, "optional": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    run = Run(Path(args.out), args.deadline_s, 0.0 if args.tiny else MIN_PART_S, report)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            work = Path(tmp)
            for name, config, steps in shapes(args.tiny):
                row = run.part(f"train_step/{name}", partial(
                    train_step_check, name, config, "sdpa", args.device, bf16, row_len, documents, steps, args.steps,
                    peak_flops, work))
                if row:
                    print_row(f"train_step/{name} sdpa", row)
            for name, config, steps in shapes(args.tiny):
                gate = run.part(f"bf16_gate/{name}", partial(bf16_gate, config, args.device, steps, row_len,
                                                             documents, work / f"gate_{name}"))
                if gate:
                    print(f"bf16_gate/{name}: logits moved {max(gate['move_rel_err']):.4f} from fp32's change, "
                          f"forward {max(gate['forward_rel_err']):.4f}: {'ok' if gate['ok'] else 'FAILED'}",
                          flush=True)
            run.part("extract_speculative", partial(extraction_and_speculative, args.device, work / "features",
                                                    train_steps=60 if args.tiny else 300))
            run.part("greedy_head", partial(greedy_head, args.device, args.tiny))
            run.part("loader", partial(loader_rows, args.tiny))
            run.part("hashing", partial(hashing, args.tiny))
            if args.no_flex:
                report["optional"]["flex_attention"] = {"skipped": "--no-flex"}
            elif args.device == "cpu":  # PyTorch: "FlexAttention does not support backward on CPU"
                report["optional"]["flex_attention"] = {"skipped": "PyTorch has no flex_attention backward on the CPU"}
            else:
                for name, config, steps in shapes(args.tiny):
                    row = run.part(f"flex_attention/{name}", partial(
                        train_step_check, name, config, "flex_attention", args.device, bf16, row_len, documents,
                        steps, args.steps, peak_flops, work), required=False)
                    if row:
                        print_row(f"flex_attention/{name}", row)
    except OutOfTime:  # between two parts: the parts not run are the ones the report lacks
        run.stopped = True
        report["notes"] = ["stopped at the deadline between parts"]
    finally:
        run.finish()
    report["seconds"] = time.perf_counter() - started
    names = [f"{part}/{name}" for part in ("train_step", "bf16_gate") for name, _, _ in shapes(args.tiny)]
    report["ok"], report["failed"] = verdict(report, [*names, "extract_speculative", "greedy_head", "loader",
                                                      "hashing"])
    run.save()
    print(f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']:.0f} s -> {args.out}"
          + "".join(f"\n  {line}" for line in report["failed"]))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
