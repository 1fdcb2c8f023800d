"""SGLang's HTTP server started with aux capture, stood in on loopback: what `extract --engine sglang` talks to.

GET /server_info answers the keys the client reads, as SGLang 0.5.23 names them (a recorded answer's, or made
for a model); POST /generate answers a request's `input_ids` with `meta_info.hidden_states[0]` (the prompt rows'
captured states, concatenated in layer order), `output_ids` (the greedy next token) and `meta_info.prompt_tokens`:

- replayed (`recording`): the answers a real SGLang gave, read from tests/data_files/sglang/ (recorded by hand,
  docs/results/), matched by the request's input_ids;
- computed (`model`): SGLang's Llama-family reader on a transformers model, each server id k capturing
  `output_hidden_states[k + 1]`.

behaviour: "ok"; "short" (one row fewer: a cached prefix); "nan" (a NaN in the second captured layer, sent as null
as SGLang's orjson writes it); "foreign" (the rows of another model); "fail:N" (500 from request N on, for good);
"drop:N" (request N's connection dropped once)."""

from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import torch

from tests.helpers.loopback import LoopbackServer, QuietHandler

RECORDINGS = Path(__file__).resolve().parents[1] / "data_files" / "sglang"


def load_recording(name: str = "smollm2_fp32.json.gz") -> dict:
    with gzip.open(RECORDINGS / name, "rt", encoding="utf-8") as f:
        return json.load(f)


class SglangStub(LoopbackServer):
    def __init__(self, *, recording: dict | None = None, model=None, model_path: str = "", layer_ids=None,
                 behaviour: str = "ok", info: dict | None = None):
        assert (recording is None) != (model is None), "replay a recording or compute with a model"
        self.recording, self.model, self.behaviour = recording, model, behaviour
        if recording is not None:
            self.info = dict(recording["server_info"])
            self.answers = {tuple(x["request"]["input_ids"]): x["response"] for x in recording["exchanges"]}
        else:
            self.info = {"version": "0.5.23", "model_path": model_path, "dtype": "float32",
                         "enable_return_aux_hidden_states": True, "return_aux_hidden_state_layer_ids": layer_ids,
                         "speculative_algorithm": None, "disable_radix_cache": True, "context_length": 512}
        self.info.update(info or {})
        self.posts = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(QuietHandler):
            def do_GET(self):
                if self.path in ("/server_info", "/get_server_info"):
                    self._send(200, stub.info)
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.posts += 1
                    number = stub.posts
                kind, _, arg = stub.behaviour.partition(":")
                if kind == "fail" and number >= int(arg):
                    self._send(500, {"error": {"message": "scheduler died"}})
                    return
                if kind == "drop" and number == int(arg):
                    self.close_connection = True
                    return  # no answer at all: the client sees the connection closed
                answer = stub.answer(request["input_ids"])
                if answer is None:
                    self._send(400, {"error": {"message": "no recorded answer for these input_ids"}})
                    return
                self._send(200, stub.damage(answer, kind, number))

        super().__init__(Handler)

    def answer(self, ids: list[int]) -> dict | None:
        if self.recording is not None:
            found = self.answers.get(tuple(ids))
            return None if found is None else json.loads(json.dumps(found))
        return self.computed(ids)

    @torch.no_grad()
    def computed(self, ids: list[int]) -> dict:
        with self.lock:  # one forward at a time on the shared model
            out = self.model(torch.tensor(ids)[None], output_hidden_states=True)
        rows = torch.cat([out.hidden_states[k + 1][0] for k in sorted(self.info["return_aux_hidden_state_layer_ids"])],
                         dim=-1)  # [T, L * H]
        token = int(out.logits[0, -1].argmax())
        return {"text": "", "output_ids": [token],
                "meta_info": {"id": "stub", "prompt_tokens": len(ids), "completion_tokens": 1,
                              "hidden_states": [rows.tolist()]}}

    @staticmethod
    def damage(answer: dict, kind: str, number: int) -> dict:
        rows = answer["meta_info"]["hidden_states"][0]
        if kind == "short":
            answer["meta_info"]["hidden_states"][0] = rows[1:]
        elif kind == "nan":
            width = len(rows[0]) // 2
            rows[0][width + 1] = None  # SGLang answers through orjson, which writes NaN as null
        elif kind == "foreign":
            g = torch.Generator().manual_seed(number)
            answer["meta_info"]["hidden_states"][0] = torch.randn(len(rows), len(rows[0]), generator=g).tolist()
        return answer
