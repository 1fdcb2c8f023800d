"""Where a verifier too big for one device goes: `--device-map`, `--max-memory` and `--offload-folder`, shared by
`extract` and `evaluate` so that both place a verifier the same way (accelerate's dispatch through
`from_pretrained(device_map=...)`)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ..errors import UsageError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def add_placement_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, budget_example: str,
                            note: str = "") -> None:
    """--device-map, --max-memory and --offload-folder; `budget_example` shows a --max-memory value, `note` ends
    --device-map's help with what the command does beside it."""
    parser.add_argument("--device-map", default=None,
                        help="auto (or balanced, sequential): shard a verifier too big for one device over the "
                             "devices of --max-memory, offloading the rest to --offload-folder; or a JSON map "
                             "(string or file) of module name -> device" + note)
    parser.add_argument("--max-memory", default=None,
                        help=f"with --device-map: per-device budget, e.g. {budget_example}")
    parser.add_argument("--offload-folder", default=None,
                        help="with --device-map: where weights that fit no device go, read back from disk at every "
                             "forward (default: a temporary folder; `extract` refuses a verifier its memory cannot "
                             "hold unless this is given)")


def placement_kwargs(args: argparse.Namespace) -> tuple[dict[str, Any], tempfile.TemporaryDirectory | None]:
    """`from_pretrained` keywords for --device-map (empty without it), and the temporary offload folder made when
    none was given (the caller keeps it while the verifier lives). Refuses the options' bad combinations."""
    if (args.max_memory or args.offload_folder) and not args.device_map:
        raise UsageError("--max-memory and --offload-folder need --device-map")
    if not args.device_map:
        return {}, None
    check_device_map_launch(args.device_map)
    kwargs: dict[str, Any] = {"device_map": parse_device_map(args.device_map)}
    if args.max_memory:
        kwargs["max_memory"] = parse_max_memory(args.max_memory)
    offload = None if args.offload_folder else tempfile.TemporaryDirectory(prefix="eagle3_offload_")
    kwargs["offload_folder"] = args.offload_folder or offload.name  # type: ignore[union-attr]
    return kwargs, offload


def check_device_map_launch(device_map: str | None, world_size: str | None = None) -> None:
    """--device-map shards one verifier over this node's devices: with several processes (WORLD_SIZE > 1) each would
    load the whole verifier over the same devices. Refused in one line."""
    world = int((world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1")) or 1)
    if device_map and world > 1:
        raise ValueError(f"--device-map {device_map} with WORLD_SIZE={world}: one process shards one verifier over the "
                         "node's GPUs; launch a single process (python -m eagle3_hf.cli, not torchrun), or drop "
                         "--device-map for data-parallel replicas of a verifier that fits one GPU")


def parse_device_map(value: str) -> str | dict[str, Any]:
    """`auto`-style strategies pass through; otherwise a JSON object (inline or a file) of module -> device."""
    if value in STRATEGIES:
        return value
    text = Path(value).read_text(encoding="utf-8") if Path(value).is_file() else value
    try:
        mapping: object = json.loads(text)
    except json.JSONDecodeError:
        raise UsageError(f"--device-map {value!r}: not auto/balanced/balanced_low_0/sequential, a JSON file or "
                         f"JSON text") from None
    if not isinstance(mapping, dict):
        raise UsageError(f"--device-map {value!r}: expected a JSON object of module name -> device")
    return mapping


def parse_max_memory(value: str) -> dict[int | str, int | str]:
    """`0=70GiB,1=70GiB,cpu=200GiB` -> {0: "70GiB", 1: "70GiB", "cpu": "200GiB"} (plain numbers are bytes)."""
    budget: dict[int | str, int | str] = {}
    for item in value.split(","):
        device, sep, size = item.partition("=")
        device, size = device.strip(), size.strip()
        if not sep or not device or not size:
            raise UsageError(f"--max-memory {value!r}: expected DEVICE=SIZE[,DEVICE=SIZE...], e.g. 0=70GiB,cpu=200GiB")
        budget[int(device) if device.isdigit() else device] = int(size) if size.isdigit() else size
    return budget
