"""The two things every experiment does besides its own logic: run a project command with its output in a log,
and decode a drafter for real on a prompt set (`eagle3-hf evaluate`), reusing a finished evaluation."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from eagle3_hf.constants import EVALUATION_FILE

CLI = [sys.executable, "-m", "eagle3_hf.cli"]


def run_logged(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None) -> float:
    """Run a stage with its output in `log`; its seconds. A failure exits with the command and the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if rc:
        tail = log.read_text(encoding="utf-8", errors="replace")[-2000:]
        raise SystemExit(f"failed (exit {rc}): {shlex.join(cmd)}\nend of {log}:\n{tail}")
    return time.perf_counter() - t0


def parse_eval_sets(specs: list[str]) -> list[tuple[str, int]]:
    """`dev=40 mt-bench=0` -> [("dev", 40), ("mt-bench", 0)]; 0 means every prompt of the set."""
    sets = []
    for spec in specs:
        name, _, n = spec.partition("=")
        if not name or not n.isdigit():
            raise SystemExit(f"--eval {spec!r}: expected PROMPTS=N, e.g. dev=40 or mt-bench=0 (all)")
        sets.append((name, int(n)))
    return sets


def evaluate_drafter_cli(drafter: Path, verifier: str, prompts: str, num_prompts: int, max_new_tokens: int,
                         log_dir: Path, env: dict | None = None) -> dict:
    """Real speculative decoding (k = 3, greedy, lossless check) of `drafter` on `num_prompts` prompts of a set
    (0: all), written inside the drafter's directory and reused when it exists; the evaluation summary."""
    eval_dir = drafter / f"eval-{prompts}-{num_prompts or 'all'}-{max_new_tokens}"
    if not (eval_dir / EVALUATION_FILE).is_file():
        run_logged([*CLI, "evaluate", "--drafter", str(drafter), "--verifier", verifier, "--prompts", prompts,
                    *(["--num-prompts", str(num_prompts)] if num_prompts else []),
                    "--max-new-tokens", str(max_new_tokens), "--k", "3", "--temperature", "0",
                    "--output", str(eval_dir), "--no-progress"], log_dir / f"{drafter.name}.{eval_dir.name}.log", env)
    return json.loads((eval_dir / EVALUATION_FILE).read_text(encoding="utf-8"))
