"""The real feature server (engines/vllm/vllm_feature_server.py: its handler, its engine thread's batching and queue)
on loopback, with vLLM's `generate` replaced by a stand-in: for the trust tests, no vLLM needed.

`FakeEngine.prefill` answers each job with {hidden_states [T, 1, 4] (the ids, as floats), token_ids [T]} and,
like vLLM, fails the whole batch when any prompt holds an id outside the vocabulary. `gate` (an Event), when
given, holds every batch until it is set: the queue then fills. `batches` lists each batch's ids.
"""

from __future__ import annotations

import importlib.util
import threading
from functools import cache
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from eagle3_hf.engines.vllm.vllm_feature_launcher import FEATURE_SERVER

from tests.helpers.loopback import LoopbackServer

VOCAB = 1000
MAX_MODEL_LEN = 64


@cache
def script() -> ModuleType:
    """vllm_feature_server.py as the vLLM venv runs it: a script beside its runner, not a package module."""
    spec = importlib.util.spec_from_file_location("vllm_feature_server_script", FEATURE_SERVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def states(ids: list[int]) -> dict[str, torch.Tensor]:
    """What the stand-in answers for `ids` (a client compares it with what it got)."""
    return {"hidden_states": torch.tensor(ids, dtype=torch.float32)[:, None, None].expand(-1, 1, 4).contiguous(),
            "token_ids": torch.tensor(ids)}


def fake_engine(batch_size: int = 8, batch_wait_s: float = 0.3, max_queue: int = 64,
                gate: threading.Event | None = None) -> Any:
    class FakeEngine(script().Engine):
        def __init__(self) -> None:
            super().__init__(None, False, batch_size, batch_wait_s, max_queue)
            self.gate, self.batches = gate, []

        def prefill(self, batch):
            if self.gate is not None:
                self.gate.wait(30)
            self.batches.append([j.ids for j in batch])
            bad = [t for j in batch for t in j.ids if not 0 <= t < VOCAB]
            if bad:  # vLLM's generate validates every prompt first: the whole call fails
                raise ValueError(f"Token id {bad[0]} is out of vocabulary")
            for j in batch:
                yield save_safetensors(states(j.ids))

    return FakeEngine()


class ScriptServer(LoopbackServer):
    """make_handler(identity, engine, MAX_MODEL_LEN, api_key) of the real script on 127.0.0.1."""

    def __init__(self, engine: Any, api_key: str | None = None):
        self.engine = engine
        identity = {"verifier": "fake", "hidden_size": 4, "num_hidden_layers": 2, "vocab_size": VOCAB,
                    "layer_ids": [2], "aux_layer_indices": [], "tokenizer_fingerprint": "fp"}
        super().__init__(script().make_handler(identity, engine, MAX_MODEL_LEN, api_key))

    def __enter__(self):
        self.engine.start()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        if self.engine.gate is not None:
            self.engine.gate.set()
        self.engine.stop()
        super().__exit__(*exc)
