"""The plan's model of `extract --engine vllm`'s reader: how many reader threads keep up with a node's engines.

vLLM's connector writes one file per sample holding 4 states per token (the 3 aux layers and vLLM's id N) in
the engine's dtype (bf16 on a GPU); each extraction process (one per engine: a rank) turns them into shards with
`--vllm-readers` threads. A reader's rate is measured in bytes of those files per second (bench/vllm_reader.py,
docs/results/vllm_reader.md), so one number serves every hidden size; the engines' rate is the plan's prefill
rate (given, or 2 x active FLOPs per token at the assumed MFU).
"""

from __future__ import annotations

import math
from typing import Any

CAPTURED_STATES = 4  # the 3 aux layers + vLLM's id N, per token
FILE_ELEMENT_BYTES = 2  # bf16, what vLLM computes in on a GPU
# GB/s of connector files one reader thread turns into shard-ready samples: the lower of bench/vllm_reader.py's two
# `reader_gbps_1` (docs/results/vllm_reader.md; measured with the final norm on the CPU, which a node runs on its GPU)
READER_GBPS = 0.35


def node_prefill_tokens_per_s(active_params: float, gpus: int, mfu: float, peak_tflops: float) -> float:
    """Prefill tokens/s of `gpus` GPUs: 2 x active parameters FLOPs per token at `mfu` of `peak_tflops`."""
    return gpus * peak_tflops * 1e12 * mfu / (2 * active_params)


def reader_plan(hidden: int, node_tokens_per_s: float, extract_gpus: int = 8, gpus_per_engine: int = 1,
                reader_gbps: float = READER_GBPS) -> dict[str, Any]:
    """Each engine's tokens/s against one reader's, and the readers that keep up: per engine (`--vllm-readers`)
    and per node (all ranks' threads together)."""
    file_bytes = CAPTURED_STATES * hidden * FILE_ELEMENT_BYTES
    per_reader = reader_gbps * 1e9 / file_bytes
    engines = max(1, extract_gpus // max(1, gpus_per_engine))
    per_engine = node_tokens_per_s / engines
    readers = max(1, math.ceil(per_engine / per_reader))
    return {"file_bytes_per_token": file_bytes, "reader_gbps": reader_gbps, "tokens_per_s_per_reader": per_reader,
            "engines": engines, "gpus_per_engine": max(1, gpus_per_engine), "tokens_per_s_per_engine": per_engine,
            "readers_per_engine": readers, "readers_per_node": engines * readers}


def reader_lines(r: dict[str, Any]) -> list[str]:
    """The reader's two lines of `eagle3-hf plan`."""
    return [f"  vLLM reader {r['file_bytes_per_token']:,} B/token of vLLM's files; one reader thread: "
            f"{r['tokens_per_s_per_reader']:,.0f} tokens/s (--reader-gbps {r['reader_gbps']:g})",
            f"              {r['engines']} engine(s) x {r['gpus_per_engine']} GPU(s) at "
            f"{r['tokens_per_s_per_engine']:,.0f} tokens/s each: --vllm-readers {r['readers_per_engine']} per "
            f"engine ({r['readers_per_node']} per node)"]
