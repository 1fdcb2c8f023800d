"""Start a vLLM runner as its own process, or as a fork of a warm vLLM process when one is listening.

`EAGLE3_HF_VLLM_WARM=SOCKET` names a warm process (engines/fork_server.py with vLLM imported, started by
`start_warm`): a runner or vLLM's API server then starts with vLLM already imported (about 8 s of one core less per
engine). The test
suite sets it for its whole session; without it, or while the warm process is not listening yet, every runner is a
fresh process as users run them. Either way the caller gets the same handle (engines/forked.py's `WarmProcess` has
Popen's `pid`, `poll()`, `wait(timeout)`, `send_signal()`, `kill()`, `returncode`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import IO, Any

from ..forked import WarmProcess, fork_from_warm, start_fork_server

WARM_ENV = "EAGLE3_HF_VLLM_WARM"
# what every runner and the API server import before their own work: the time a fork saves
WARM_IMPORTS = ["vllm", "vllm:LLM", "vllm:SamplingParams", "vllm.inputs:TokensPrompt", "vllm.v1.engine.core",
                "vllm.entrypoints.openai.api_server"]
# read by the runners themselves, or by nothing vLLM imports (the search path: by a shell, or `shutil.which`;
# whether the engine core runs in its own process: by vLLM's settings, read when the engine starts; torchrun's NCCL
# setting, which a runner started by a rank inherits: by torch when a process group starts)
RUN_TIME_VARIABLES = ["OMP_NUM_THREADS", "PYTHONPATH", "VLLM_API_KEY", "PATH", "DEMO_*",
                      "VLLM_ENABLE_V1_MULTIPROCESSING", "TORCH_NCCL_ASYNC_ERROR_HANDLING"]

__all__ = ["WARM_ENV", "WarmProcess", "launch", "start_warm"]


def launch(argv: list[str], env: dict[str, str], stdout: IO[Any] | int | None = None,
           stderr: IO[Any] | int | None = None, start_new_session: bool = False) -> subprocess.Popen | WarmProcess:
    """Start `argv` ([vLLM's python, runner script, args...] or [vLLM's python, "-m", module, args...]: vLLM's API
    server) with `env`: forked from the warm process named by EAGLE3_HF_VLLM_WARM when it listens and takes the job,
    else a new process. `stderr=subprocess.STDOUT` as Popen's."""
    path = os.environ.get(WARM_ENV, "")
    if path and len(argv) > 2 and argv[1] == "-m":
        run, args = {"module": argv[2]}, argv[2:]
    elif path and len(argv) > 1 and argv[1].endswith(".py"):
        run, args = {"path": argv[1]}, argv[1:]
    else:
        path = ""
    if path:
        job = {"python": argv[0], "run": run, "argv": args, "env": env, "new_session": start_new_session}
        forked = fork_from_warm(path, job, stdout, stderr)
        if forked is not None:
            return forked
    return subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr, start_new_session=start_new_session)


def start_warm(python: str | Path, env: dict[str, str], socket_path: str | Path,
               log: IO[Any] | None = None) -> subprocess.Popen:
    """Start the warm vLLM process (it listens on `socket_path` once vLLM is imported); stop it with terminate()."""
    return start_fork_server(python, env, socket_path, WARM_IMPORTS, RUN_TIME_VARIABLES, log)
