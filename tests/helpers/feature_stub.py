"""A stand-in for the vLLM feature server (vllm_feature_server.py) on loopback, and the offline shards the same
states make: what the online-endpoint and feature-cache tests compare against.

The stub answers GET /identity and POST /features with the safetensors bytes of {hidden_states [T, layers, H],
token_ids [T]}, computed by transformers in vLLM's layout (aux ids as output_hidden_states, id N before the
final norm)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save as save_safetensors

from eagle3_hf.data.prepared_samples import PreparedDataset
from eagle3_hf.features.engine_states import features_from_states, vllm_layer_ids
from eagle3_hf.features.records import make_header
from eagle3_hf.features.routes.feature_server_client import ServerFeatures, served_identity
from eagle3_hf.features.shard_writer import ShardWriter
from eagle3_hf.features.store import merge_manifests
from eagle3_hf.verifier.capture import final_norm
from eagle3_hf.verifier.family import default_aux_indices

from tests.helpers.loopback import LoopbackServer, QuietHandler
from tests.helpers.serveable import HIDDEN, LAYERS, VOCAB, reference_states

AUX = list(default_aux_indices(LAYERS))
LAYER_IDS = vllm_layer_ids(AUX, LAYERS)


def vllm_layout(model, ids: torch.Tensor) -> torch.Tensor:
    """[T, len(LAYER_IDS), H]: what vLLM's connector writes for these ids."""
    hs, pre = reference_states(model, ids)
    return torch.stack([hs[i] for i in LAYER_IDS[:-1]] + [pre], dim=1).contiguous()


class Stub(LoopbackServer):
    """A feature server stand-in on loopback. behaviour: "ok", "slow" (never answers in time), "down:N" (503 for
    the first N requests), "nan:ID" (a NaN in the sample whose first token is ID), "hang:N" (every request after
    the first N waits 60 s). `requested` lists the token ids of every request, in arrival order."""

    def __init__(self, model, identity: dict, behaviour: str = "ok"):
        self.model, self.identity, self.behaviour, self.posts = model, identity, behaviour, 0
        self.requested: list[tuple[int, ...]] = []
        self.lock = threading.Lock()  # reference_states hooks the shared model: one forward at a time
        stub = self

        class Handler(QuietHandler):
            def _send(self, status, body, kind="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except BrokenPipeError:  # the client gave up (timed out) first
                    pass

            def do_GET(self):
                self._send(200, json.dumps(stub.identity).encode())

            def do_POST(self):
                ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["ids"]
                stub.posts += 1
                stub.requested.append(tuple(ids))
                kind, _, arg = stub.behaviour.partition(":")
                if kind == "slow":
                    time.sleep(3)
                if kind == "hang" and stub.posts > int(arg):
                    time.sleep(60)
                if kind == "down" and stub.posts <= int(arg):
                    self._send(503, json.dumps({"error": "restarting"}).encode())
                    return
                with stub.lock:
                    states = vllm_layout(stub.model, torch.tensor(ids))
                if kind == "nan" and ids[0] == int(arg):
                    states[2, 1, 5] = float("nan")
                data = save_safetensors({"hidden_states": states, "token_ids": torch.tensor(ids)})
                self._send(200, data, "application/octet-stream")

        super().__init__(Handler)


def identity(fingerprint: str, hidden: int = HIDDEN, layers: int = LAYERS) -> dict:
    return {"verifier": "stub", "hidden_size": hidden, "num_hidden_layers": layers, "layer_ids": LAYER_IDS,
            "aux_layer_indices": AUX, "tokenizer_fingerprint": fingerprint, "vllm_version": "stub"}


def server_source(client, model, fingerprint: str, dtype: str = "bfloat16", max_in_flight: int = 4):
    """The feature server route (ServerFeatures) over `client`, mapping the stub's states with `model`'s head."""
    served = identity(fingerprint)
    return ServerFeatures(client, served, final_norm(model), model.lm_head, None,
                          served_identity(client.url, served, dtype, fingerprint, VOCAB), max_in_flight)


def offline_features(model, prepared: Path, out: Path, fingerprint: str, dtype: str) -> Path:
    """The shards extract --engine vllm writes from these states (the same mapping, the same writer)."""
    info = {"name": "stub", "revision": None, "num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "vocab_size": VOCAB}
    writer = ShardWriter(out, make_header(info, fingerprint, AUX, dtype, source="vllm"), samples_per_shard=4)
    every = PreparedDataset(prepared, "all", 0.2, fingerprint)
    for i, sample_id in enumerate(every.sample_ids):
        row = every[i]
        f = features_from_states(vllm_layout(model, row["input_ids"]), AUX, LAYER_IDS, final_norm(model),
                                 model.lm_head, None)
        writer.add(sample_id, row["input_ids"], row["loss_mask"], f["aux_hidden_states"], f["last_hidden_state"],
                   f["verifier_greedy"])
    writer.close()
    merge_manifests(out)
    return out
