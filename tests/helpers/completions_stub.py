"""vLLM's OpenAI server started with the extraction config (`eagle3-hf serve-vllm`), stood in on loopback.

GET /v1/models lists the verifier, the layer-ids name and the storage name (unless name_storage is False);
POST /v1/completions answers at once with
`kv_transfer_params.hidden_states_path` and the greedy next token, having created PATH.lock with LOCK_EX (as
vLLM's worker does), and writes {hidden_states [T, layers, H], token_ids [T]} computed by transformers in
vLLM's layout (feature_stub.vllm_layout) `write_delay` s later in another thread, then releases the lock: the
client must wait on the lock, as with vLLM. The file is named as vLLM's connector names it:
`cmpl-<X-Request-Id>-0-<8 hex>.safetensors`.

behaviour: "ok"; "plain" (no kv_transfer_params: a server without the extraction config); "foreign" (the last
saved state is not this verifier's: another model's, or another layer's of a deeper one); "never" (the lock is
never released: a hung writer); "full" (the lock released, no file: a write that failed on a full disk);
"elsewhere" (its storage, named and answered, a directory this machine does not have); "fail:N" (500 from
request N on, for good). A hostile server overrides `answer_path`, `place` and `respond` (hostile_vllm.py)."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3_hf.engines.vllm.vllm_openai import STORAGE_NAME, layers_name

from tests.helpers.feature_stub import LAYER_IDS, vllm_layout
from tests.helpers.loopback import LoopbackServer, QuietHandler


class CompletionsStub(LoopbackServer):
    def __init__(self, model, root: str, storage: Path, behaviour: str = "ok", layer_ids=LAYER_IDS,
                 max_model_len: int = 512, write_delay: float = 0.05, name_storage: bool = True,
                 api_key: str | None = None):
        self.model, self.root, self.storage, self.behaviour = model, root, Path(storage), behaviour
        self.api_key = api_key  # like vLLM's --api-key: every /v1 request without `Bearer KEY` is a 401
        self.name_storage = name_storage
        self.layer_ids, self.max_model_len, self.write_delay = list(layer_ids), max_model_len, write_delay
        self.posts = 0
        self.lock = threading.Lock()
        self.storage.mkdir(parents=True, exist_ok=True)
        stub = self

        class Handler(QuietHandler):
            def _refused(self) -> bool:
                if stub.api_key is None or self.headers.get("Authorization") == f"Bearer {stub.api_key}":
                    return False
                self._send(401, {"error": "Unauthorized"})  # vLLM's AuthenticationMiddleware's answer
                return True

            def do_GET(self):
                if self._refused():
                    return
                names = [stub.root, layers_name(stub.layer_ids)]
                if stub.name_storage:
                    names.append(STORAGE_NAME + str(stub.named_storage))
                cards = [{"id": name, "root": stub.root, "max_model_len": stub.max_model_len} for name in names]
                self._send(200, {"object": "list", "data": cards})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._refused():
                    return
                with stub.lock:
                    stub.posts += 1
                    number = stub.posts
                kind, _, arg = stub.behaviour.partition(":")
                if kind == "fail" and number >= int(arg):
                    self._send(500, {"error": {"message": "engine dead"}})
                    return
                ids = torch.tensor(request["prompt"])
                with stub.lock:  # the hooks of the shared model: one forward at a time
                    states = vllm_layout(stub.model, ids)
                    next_token = int(stub.model(ids[None]).logits[0, -1].argmax())
                if kind == "foreign":
                    states[:, -1] = torch.randn(states[:, -1].shape, generator=torch.Generator().manual_seed(number))
                answer = {"id": f"cmpl-{number}", "system_fingerprint": "vllm-0.32.0-stub",
                          "choices": [{"index": 0, "text": "", "token_ids": [next_token]}],
                          "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}}
                if kind != "plain":
                    request_id = self.headers.get("X-Request-Id") or f"stub{number}"
                    path = stub.answer_path(request_id, number)
                    answer["kv_transfer_params"] = {"hidden_states_path": str(path)}
                    if kind != "elsewhere":
                        stub.place(Path(path), {"hidden_states": states.contiguous(), "token_ids": ids}, kind)
                stub.respond(self, answer)

        super().__init__(Handler)

    @property
    def named_storage(self) -> Path:
        return Path("/nonexistent-storage") if self.behaviour == "elsewhere" else self.storage

    def answer_path(self, request_id: str, number: int) -> str | Path:
        """Where vLLM's connector writes this request's states (what the answer names)."""
        return self.named_storage / f"cmpl-{request_id}-0-{number:08x}.safetensors"

    def place(self, path: Path, tensors: dict, kind: str) -> None:
        """As vLLM's worker: the lock held before the answer leaves, the file written later, then the lock let go."""
        fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        threading.Thread(target=self._write, args=(path, tensors, fd, kind), daemon=True).start()

    def respond(self, handler, answer: dict) -> None:
        handler._send(200, answer)

    def _write(self, path: Path, tensors: dict, fd: int, kind: str) -> None:
        time.sleep(self.write_delay)
        if kind == "never":
            return  # the lock stays held: the client must give up at its timeout
        if kind != "full":  # "full": vLLM's writer releases the lock in a finally, after its save raised
            save_file(tensors, str(path))
        os.close(fd)
