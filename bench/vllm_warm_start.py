"""What the warm vLLM process (engines/vllm/warm_launch.py, EAGLE3_HF_VLLM_WARM) saves per engine start: one
`run_vllm` request (a tiny verifier, plain decoding of one prompt) started as a fresh process and forked from the
warm process, alternately in one run, --rounds each. CPU seconds are the runner's own (a fresh process's reaped
rusage, the warm children's from the warm process's count), wall seconds the caller's; the warm process's own
import is printed beside them (paid once per test session).

    python -m bench.vllm_warm_start [--rounds 3]     # needs `make vllm`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import IO

from eagle3_hf.engines.vllm.vllm_env import run_vllm, vllm_environment, vllm_python, vllm_venv
from eagle3_hf.engines.vllm.vllm_request import GenerationRequest
from eagle3_hf.engines.vllm.warm_launch import WARM_ENV, start_warm

from bench.warm_timing import fresh_against_warm
from tests.helpers.serveable import serveable_verifier


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from eagle3_hf.verifier.loading import default_verifier_dir, load_tokenizer

    folder = tempfile.mkdtemp(prefix="eagle3_warm_bench_")
    verifier = Path(folder) / "verifier"
    serveable_verifier().save_pretrained(verifier)
    load_tokenizer(default_verifier_dir()).save_pretrained(verifier)
    request = GenerationRequest(verifier=str(verifier), prompts=[[1, 2, 3, 4, 5]], max_new_tokens=8, max_model_len=256)

    def start(sock: str, log: IO[str]) -> subprocess.Popen:
        return start_warm(vllm_python(), vllm_environment(vllm_venv(), 1, offline=True), sock, log)

    def run(sock: str | None) -> None:
        if sock:
            os.environ[WARM_ENV] = sock
        else:
            os.environ.pop(WARM_ENV, None)
        run_vllm(request)

    print(json.dumps(fresh_against_warm(start, folder, run, args.rounds)))


if __name__ == "__main__":
    main()
