"""The environment an engine child starts with: the user's, less what a launcher set for *our* process.

Under `torchrun` / `accelerate launch` each rank carries the launcher's rendezvous variables (torch's
elastic agent, torch/distributed/elastic/agent/server/local_elastic_agent.py, sets them for every worker).
A vLLM engine this rank starts is not a member of that job: inherited, `RANK`/`WORLD_SIZE`/`LOCAL_RANK` tell
it it is one rank of a larger world and `MASTER_ADDR`/`MASTER_PORT` point its own process group at the
launcher's store, where a TP8 engine's workers would meet torchrun's ranks instead of each other. Everything
else the user set (HF_HUB_OFFLINE, HF_TOKEN, HF_HOME, proxies, CUDA_VISIBLE_DEVICES, NCCL_*) is kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# what torchrun's agent sets in each worker (LOCAL_RANK by its _set_local_rank_env), accelerate's launcher
# through it; TORCHELASTIC_* also covers the error file, restart counters and the run id
LAUNCHER_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
})
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)


def launcher_variable(name: str) -> bool:
    """Whether `name` is one of the launcher's per-rank variables (not a user setting)."""
    return name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def engine_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) without the launcher's variables: what an engine child starts from."""
    source = os.environ if env is None else env
    return {k: v for k, v in source.items() if not launcher_variable(k)}
