"""The plan's model of `extract --engine vllm`'s reader: how many reader threads keep up with a node's engines.

vLLM's connector writes one file per sample holding 4 states per token (the 3 aux layers and vLLM's id N) in
the engine's dtype (bf16 on a GPU); each extraction process (one per engine: a rank) turns them into shards with
`--vllm-readers` threads. A reader's rate is measured in bytes of those files per second (bench/vllm_reader.py,
docs/results/vllm_reader.md), so one number serves every hidden size; the engines' rate is the plan's prefill
rate (given, or 2 x active FLOPs per token at the assumed MFU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CAPTURED_STATES = 4  # the 3 aux layers + vLLM's id N, per token
FILE_ELEMENT_BYTES = 2  # bf16, what vLLM computes in on a GPU
# GB/s of connector files one reader thread turns into shard-ready samples: the lower of bench/vllm_reader.py's two
# `reader_gbps_1` (docs/results/vllm_reader.md; measured with the final norm on the CPU, which a node runs on its GPU)
READER_GBPS = 0.35


def node_prefill_tokens_per_s(active_params: float, gpus: int, mfu: float, peak_tflops: float) -> float:
    """Prefill tokens/s of `gpus` GPUs: 2 x active parameters FLOPs per token at `mfu` of `peak_tflops`."""
    return gpus * peak_tflops * 1e12 * mfu / (2 * active_params)


@dataclass(frozen=True)
class ReaderPlan:
    """The readers that keep up with the engines' files (`reader_plan`)."""

    file_bytes_per_token: int
    reader_gbps: float
    tokens_per_s_per_reader: float
    engines: int
    gpus_per_engine: int
    tokens_per_s_per_engine: float
    readers_per_engine: int
    nodes: int
    engines_per_node: int
    readers_per_node: int

    def lines(self) -> list[str]:
        """The reader's two lines of `eagle3-hf plan`."""
        return [f"  vLLM reader {self.file_bytes_per_token:,} B/token of vLLM's files; one reader thread: "
                f"{self.tokens_per_s_per_reader:,.0f} tokens/s (--reader-gbps {self.reader_gbps:g})",
                f"              {self.engines} engine(s) x {self.gpus_per_engine} GPU(s)"
                + (f" on {self.nodes} nodes" if self.nodes > 1 else "")
                + f" at {self.tokens_per_s_per_engine:,.0f} tokens/s each: --vllm-readers {self.readers_per_engine} "
                f"per engine ({self.readers_per_node} per node)"]


def reader_plan(hidden: int, node_tokens_per_s: float, extract_gpus: int = 8, gpus_per_engine: int = 1,
                reader_gbps: float = READER_GBPS, nodes: int = 1) -> ReaderPlan:
    """Each engine's tokens/s against one reader's, and the readers that keep up: per engine (`--vllm-readers`)
    and per node (the threads of the node's own engines: `extract_gpus` and `node_tokens_per_s` count every
    node's)."""
    file_bytes = CAPTURED_STATES * hidden * FILE_ELEMENT_BYTES
    per_reader = reader_gbps * 1e9 / file_bytes
    engines = max(1, extract_gpus // max(1, gpus_per_engine))
    per_engine = node_tokens_per_s / engines
    readers = max(1, math.ceil(per_engine / per_reader))
    engines_per_node = math.ceil(engines / max(1, min(nodes, engines)))
    return ReaderPlan(file_bytes, reader_gbps, per_reader, engines, max(1, gpus_per_engine), per_engine, readers,
                      max(1, nodes), engines_per_node, engines_per_node * readers)


@dataclass(frozen=True)
class EngineSize:
    """The GPUs one extraction engine spans (`engine_size`); `problem`: why no engine can hold the weights."""

    gpus_per_engine: int
    derived: bool  # not given by --extract-gpus-per-engine
    weight_share: float
    gpus_at_80: int
    problem: str | None


def engine_size(weight_bytes: float, what: str, gpu_gib: float, gpus_per_node: int,
                given: int | None = None) -> EngineSize:
    """The GPUs one extraction engine spans: `given` (--extract-gpus-per-engine), else the fewest (a power of two)
    whose memory at 80 % holds the verifier's weights, at most the node's. `problem`: one line when the weights
    alone exceed the engine's GPUs (`what` describes the weights: footprint.Footprint.describe), else None."""
    from ..verifier.footprint import engine_gpus

    gpu_bytes = gpu_gib * 2**30
    problem = None
    if given is not None:
        gpus = given
        if given * gpu_bytes < weight_bytes:
            problem = (f"the verifier's weights take {what}, more than --extract-gpus-per-engine {given} x "
                       f"--gpu-memory-gib {gpu_gib:g} hold: an engine needs at least "
                       f"{math.ceil(weight_bytes / gpu_bytes)} such GPUs")
    else:
        gpus = min(engine_gpus(weight_bytes, gpu_bytes), max(1, gpus_per_node))
        if engine_gpus(weight_bytes, gpu_bytes, 1.0) > gpus_per_node:
            problem = (f"the verifier's weights take {what}, more than the {gpus_per_node} GPU(s) of "
                       f"{gpu_gib:g} GiB of a node (--extract-gpus, --gpu-memory-gib) hold: no engine of one node "
                       "can load them")
    return EngineSize(gpus, given is None, weight_bytes / (gpus * gpu_bytes), engine_gpus(weight_bytes, gpu_bytes),
                      problem)
