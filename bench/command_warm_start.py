"""What the warm process for our own commands (engines/forked.py, EAGLE3_HF_WARM) saves per process: the training
script's `--help` (it imports torch, transformers and the Trainer before it can answer) started as a fresh process
and handed to a fork of the warm process, alternately in one run, --rounds each. CPU seconds are the process's and
its fork's (the process's reaped rusage, the fork's from the warm process's count), wall seconds the caller's; the
warm process's own import is printed beside them (paid once per test session and worker).

    python -m bench.command_warm_start [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

from eagle3_hf.engines.forked import COMMANDS_WARM_ENV, start_fork_server

from bench.warm_timing import fresh_against_warm
from tests.helpers.warm_commands import RUN_TIME_VARIABLES, WARM_IMPORTS

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != COMMANDS_WARM_ENV} | {"OMP_NUM_THREADS": "1"}

    def start(sock: str, log: IO[str]) -> subprocess.Popen:
        return start_fork_server(sys.executable, env, sock, WARM_IMPORTS, RUN_TIME_VARIABLES, log)

    def run(sock: str | None) -> None:
        job_env = env if sock is None else env | {COMMANDS_WARM_ENV: sock}
        subprocess.run([sys.executable, str(ROOT / "examples/train.py"), "--help"], env=job_env, check=True,
                       stdout=subprocess.DEVNULL, cwd=ROOT)

    folder = tempfile.mkdtemp(prefix="eagle3_cmd_bench_")
    print(json.dumps(fresh_against_warm(start, folder, run, args.rounds)))


if __name__ == "__main__":
    main()
