"""The session's warm process for our own commands (engines/forked.py): every `eagle3-hf ...`, `python -m
eagle3_hf.cli ...` and training-script process a test starts, directly or through a script or a launcher, is a fork
of it with torch, transformers and the command modules imported (about 2.5 CPU s less per command, 5.5 per
training process). A process whose environment differs in a variable an import may have read (the loopback Hub's
endpoint, another HF_HOME, ...) starts fresh, as does every one while the warm process is still importing.
EAGLE3_HF_TEST_COLD=1 turns it off (to measure what it saves, or to rule it out)."""

from __future__ import annotations

import os
import sys

from tests.helpers.warm import Started, start_warm_process, stop_warm_process

COLD_ENV = "EAGLE3_HF_TEST_COLD"

# what our commands import before their own work
WARM_IMPORTS = ["torch", "transformers", "transformers:AutoModelForCausalLM", "transformers:AutoTokenizer",
                "transformers:Trainer", "transformers:TrainingArguments", "safetensors.torch", "datasets", "accelerate",
                "eagle3_hf.cli", "eagle3_hf.scripts.train", "eagle3_hf.verifier.loading",
                "eagle3_hf.model.modeling_eagle3", "eagle3_hf.model.modeling_dflash"]
# what a launcher sets for each rank (torchrun, accelerate launch), the demo's script for each command (its search
# path, its own DEMO_ settings), a test for argparse's width or inductor in the test's process (for the code it
# compiled there): read when the job runs (torch.distributed's and accelerate's setup, torch.cuda's check,
# `shutil.which`, argparse's help, inductor's loader), by nothing an import above reads
RUN_TIME_VARIABLES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_*",
                      "ACCELERATE_*", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTORCH_NVML_BASED_CUDA_CHECK",
                      "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "COLUMNS", "LINES", "PATH", "DEMO_*",
                      "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"]


def start_warm_commands() -> Started | None:
    """Start this worker's warm process for our commands, unless turned off or one is already set."""
    from eagle3_hf.engines.forked import COMMANDS_WARM_ENV, start_fork_server

    if os.environ.get(COLD_ENV, "").strip() not in ("", "0") or os.environ.get(COMMANDS_WARM_ENV):
        return None
    return start_warm_process(lambda path, log: start_fork_server(sys.executable, dict(os.environ), path,
                                                                  WARM_IMPORTS, RUN_TIME_VARIABLES, log),
                              COMMANDS_WARM_ENV)


def stop_warm_commands(started: Started | None) -> None:
    from eagle3_hf.engines.forked import COMMANDS_WARM_ENV

    stop_warm_process(started, COMMANDS_WARM_ENV)
