"""A checkpoint's own code copied into transformers' modules cache by one process at a time, local rank 0 first.

transformers copies a checkpoint's code files (auto_map) into HF_MODULES_CACHE and imports them from there; a file
it finds missing or different it rewrites in place (dynamic_module_utils.get_cached_module_file: shutil.copyfile,
which truncates first). Eight ranks of `torchrun --nproc-per-node 8` opening Kimi-K2.5 with a cold cache do that at
once, and a rank importing while another rewrites reads half a file (a SyntaxError, or a class missing from the
module): the copy race TensorRT-LLM met with Kimi-K2.5. Here every load of remote code holds an exclusive lock on
one file in the modules cache, and under a launcher the node's local rank 0 goes first: the other ranks wait until
it has loaded (bounded: FIRST_WAIT_S) and then find the files in place. The engine children a rank starts later
(vLLM, same cache and file layout) find them in place too.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".eagle3_hf_remote_code.lock"
FIRST_WAIT_S = 600.0  # how long a rank waits for local rank 0's first load before it goes on (under the lock)


def modules_cache() -> Path:
    """transformers' modules cache, as it resolved it (HF_MODULES_CACHE, else $HF_HOME/modules)."""
    from transformers import dynamic_module_utils

    return Path(dynamic_module_utils.HF_MODULES_CACHE)


def first_marker(env: Mapping[str, str] = os.environ) -> Path | None:
    """The file local rank 0 writes once it has loaded, named for this launch on this node (the launcher's process,
    every local rank's parent, and its run id); None outside a launch of several local ranks."""
    if int(env.get("LOCAL_WORLD_SIZE", "1") or 1) <= 1 or "LOCAL_RANK" not in env:
        return None
    run = "".join(c for c in env.get("TORCHELASTIC_RUN_ID", "") if c.isalnum() or c in "-_")[:64]
    return Path(tempfile.gettempdir()) / f"eagle3_hf_remote_code_{os.getppid()}_{run}.loaded"


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created); none where the directory cannot be written (transformers fails
    there anyway, with its own message)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+b")
    except OSError:
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # releases the lock


@contextmanager
def one_loader_at_a_time(env: Mapping[str, str] = os.environ, wait_s: float = FIRST_WAIT_S) -> Iterator[None]:
    """Around a load that may copy remote code into the modules cache (module docstring)."""
    marker = first_marker(env)
    first = marker is not None and int(env.get("LOCAL_RANK", "0") or 0) == 0
    if marker is not None and not first:
        deadline = time.monotonic() + wait_s
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        with exclusive(modules_cache() / LOCK_NAME):
            yield
    finally:
        if first and marker is not None:
            marker.touch()
