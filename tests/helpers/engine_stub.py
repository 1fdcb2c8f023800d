"""A stand-in for a vLLM or SGLang server that serves a drafter, for `check --endpoint`'s fast tests: each chat
completion "accepts" the next entry of `steps` (accepted drafts per verify step, for one answer) and reports it as
the engine does. vLLM: cumulative Prometheus counters on /metrics, in the text shape vLLM 0.32 writes (HELP/TYPE
lines, one label set per engine, `_created` samples); SGLang: `sglext.spec_tokens_details` in the answer and
`speculative_num_steps` in /server_info (0.5.23's shapes)."""

from __future__ import annotations

import json
import threading

from tests.helpers.loopback import LoopbackServer, QuietHandler

MODEL = "verifier"


def vllm_metrics(drafts: int, per_pos: list[int], k: int, engines: int = 1) -> str:
    """vLLM's /metrics text for these totals (split over `engines` label sets, as a DP server has)."""
    lines = []

    def counter(name: str, help_text: str, values: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP vllm:{name}_total {help_text}", f"# TYPE vllm:{name}_total counter"])
        lines.extend(f"vllm:{name}_total{{{labels}}} {value}" for labels, value in values)
        lines.extend(f"vllm:{name}_created{{{labels}}} 1.7e+09" for labels, _ in values)

    def share(total: int, e: int) -> float:
        return float(total // engines + (total % engines if e == 0 else 0))

    base = [f'engine="{e}",model_name="{MODEL}"' for e in range(engines)]
    lines += ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
              "# TYPE vllm:num_requests_running gauge"] + [f"vllm:num_requests_running{{{b}}} 0.0" for b in base]
    counter("spec_decode_num_drafts", "Number of spec decoding drafts.",
            [(b, share(drafts, e)) for e, b in enumerate(base)])
    counter("spec_decode_num_draft_tokens", "Number of draft tokens.",
            [(b, share(drafts * k, e)) for e, b in enumerate(base)])
    counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.",
            [(b, share(sum(per_pos), e)) for e, b in enumerate(base)])
    counter("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            [(f'{b},position="{j}"', share(per_pos[j], e)) for e, b in enumerate(base) for j in range(k)])
    return "\n".join(lines) + "\n"


class EngineStub(LoopbackServer):
    """`engine` "vllm" or "sglang" with k drafts per step; `answers[i]`: accepted drafts per verify step of answer i
    (cycled). `vllm_drafts` False: a vLLM server without a drafter (no spec-decode counters)."""

    def __init__(self, engine: str, answers: list[list[int]], k: int = 3, vllm_drafts: bool = True):
        self.engine, self.answers, self.k = engine, answers, k
        self.drafts, self.per_pos = 11, [7, 4, 2][:k] + [0] * max(0, k - 3)  # earlier traffic: the check subtracts it
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                elif self.path == "/metrics" and stub.engine == "vllm":
                    text = vllm_metrics(stub.drafts, stub.per_pos, stub.k, engines=2) if vllm_drafts else (
                        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 0.0\n")
                    body = text.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/server_info" and stub.engine == "sglang":
                    self._send(200, {"version": "0.5.23", "speculative": {"speculative_algorithm": "EAGLE3",
                                                                           "speculative_num_steps": stub.k,
                                                                           "speculative_eagle_topk": 1}})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    steps = stub.answers[len(stub.requests) % len(stub.answers)]
                    stub.requests.append(body)
                    stub.drafts += len(steps)
                    for a in steps:
                        for j in range(a):
                            stub.per_pos[j] += 1
                answer = {"id": "x", "object": "chat.completion", "model": MODEL,
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                                       "finish_reason": "length"}],
                          "usage": {"completion_tokens": 1 + sum(a + 1 for a in steps)}}
                if stub.engine == "sglang" and body.get("return_spec_tokens_details"):
                    histogram = [0] * (stub.k + 1)
                    for a in steps:
                        histogram[a] += 1
                    answer["sglext"] = {"spec_tokens_details": {
                        "spec_verify_ct": len(steps), "spec_num_correct_drafts": sum(steps),
                        "spec_num_proposed_drafts": stub.k * len(steps), "spec_correct_drafts_histogram": histogram,
                        "spec_accept_length": answer["usage"]["completion_tokens"] / len(steps)}}
                self._send(200, answer)

        super().__init__(Handler)
