"""What SGLang's JSON answers cost the `extract --engine sglang` client, against reading the same rows from a shard.

SGLang returns the captured aux states as JSON floats (`meta_info.hidden_states[0]`, one list of L x H numbers
per prompt token). The route's client reads each answer with a JSON parser and checks it into a tensor (its
`check_answer`, features/routes/sglang_server_client.py); an offline shard holds the same rows as bf16 safetensors.
This bench
builds one answer of `--tokens` rows at each shape (SmolLM2-135M's 4 captured layers x 576, Llama-3.1-8B's
4 x 4096, Kimi-K2.5's 4 x 7168; random states of a verifier's magnitude, written as JSON numbers as SGLang
writes them) and times, alternately in one process on one thread: (a) parsing and checking the answer, with the standard
library's `json` and, where installed, orjson (which the client then uses); (b) loading the same rows from a bf16
safetensors file; (c) what SGLang's scheduler does to every answer before it leaves the process that drives the
GPUs (`states.cpu().clone().tolist()`, scheduler_components/batch_result_processor.py in 0.5.23); best of
`--repeats`. Per shape it prints the bytes per token of the answer and of the shard, the tokens/s of each, the
client's (its faster parser) over the shard's, and, beside the prefill rate `eagle3-hf plan` gives a node of 8 GPUs
for that verifier (2 x active FLOPs at --mfu), how many client cores keep up and what share of that rate the
scheduler's `tolist` alone lets through.

    .venv/bin/python -m bench.sglang_answer [--tokens 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_hf.features.routes.sglang_server_client import check_answer, json_parser
from eagle3_hf.train.plan import verifier_params
from eagle3_hf.train.plan_reader import node_prefill_tokens_per_s

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # name: (hidden, layers captured: three aux + the last layer's input, the text config `plan` reads)
    "smollm2-135m": (576, 4, None),
    "llama-3.1-8b": (4096, 4, ROOT / "examples/recipes/llama31_8b_text_config.json"),
    "kimi-k2.5": (7168, 4, ROOT / "examples/recipes/kimi_k25_text_config.json"),
}


def answer_bytes(rows: torch.Tensor) -> bytes:
    """A /generate answer as SGLang writes it: the rows as nested lists of Python floats."""
    return json.dumps({"meta_info": {"hidden_states": [rows.flatten(1).tolist()], "prompt_tokens": rows.shape[0]},
                       "output_ids": [0]}).encode()


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name: str, tokens: int, repeats: int, mfu: float, peak_tflops: float, folder: Path) -> dict:
    hidden, layers, text_config = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(tokens, layers, hidden, generator=g) * 0.5  # [T, L, H] float32
    body = answer_bytes(rows)
    shard = folder / f"{name}.safetensors"
    save_file({"aux_hidden_states": rows.to(torch.bfloat16).contiguous()}, str(shard))
    parsed = check_answer(json.loads(body), "bench", "s0", tokens, layers, hidden)
    assert torch.equal(parsed, rows), "the answer reads back as written"
    # alternated, so that all see the same load on a shared machine; best of `repeats`
    json_s = orjson_s = shard_s = tolist_s = math.inf
    flat = rows.flatten(1)
    parser, loads = json_parser()  # orjson where installed (the client's own choice)
    for _ in range(repeats):
        json_s = min(json_s, seconds(lambda: check_answer(json.loads(body), "bench", "s0", tokens, layers, hidden)))
        if parser == "orjson":
            orjson_s = min(orjson_s, seconds(lambda: check_answer(loads(body), "bench", "s0", tokens, layers, hidden)))
        shard_s = min(shard_s, seconds(lambda: load_file(str(shard))["aux_hidden_states"].float()))
        tolist_s = min(tolist_s, seconds(lambda: flat.cpu().clone().tolist()))
    client_s = min(json_s, orjson_s)
    out = {"shape": f"{layers} x {hidden}", "tokens": tokens,
           "json_bytes_per_token": round(len(body) / tokens), "shard_bytes_per_token": layers * hidden * 2,
           "json_tokens_per_s": round(tokens / json_s, 1),
           "orjson_tokens_per_s": round(tokens / orjson_s, 1) if parser == "orjson" else None,
           "shard_tokens_per_s": round(tokens / shard_s, 1),
           "ratio_client_over_shard": round(shard_s / client_s, 4),
           "scheduler_tolist_tokens_per_s": round(tokens / tolist_s, 1)}
    if text_config is not None:
        active = verifier_params(json.loads(text_config.read_text(encoding="utf-8")))["active"]
        node = node_prefill_tokens_per_s(active, 8, mfu, peak_tflops)
        out |= {"plan_node_prefill_tokens_per_s": round(node),
                "client_cores_to_keep_up": math.ceil(node / (tokens / client_s)),
                "scheduler_tolist_share_of_prefill": round(tokens / tolist_s / node, 4)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256, help="rows in one answer (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mfu", type=float, default=0.35, help="as `eagle3-hf plan --mfu`")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="as `eagle3-hf plan --peak-tflops` (H100/H200)")
    args = p.parse_args()
    torch.set_num_threads(1)
    report = {"threads": 1, "load_average": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="eagle3_bench_sglang_") as tmp:
        for name in SHAPES:
            report[name] = measure(name, args.tokens, args.repeats, args.mfu, args.peak_tflops, Path(tmp))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
