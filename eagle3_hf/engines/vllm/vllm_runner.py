"""Generate with vLLM, plain or with a drafter (EAGLE-3 or DFlash), from a JSON request; write a JSON result.

Runs inside the vLLM venv (see scripts/install_vllm.sh), executed by path, so it imports only the standard
library and vllm: never eagle3_hf, whose torch and transformers pins differ from vLLM's.

    python vllm_runner.py REQUEST.json RESULT.json

Request: {"verifier", "drafter" (path or repo id; null: plain decoding), "drafter_revision", "method" (vLLM's
speculative method for the drafter's kind, engines/table.py: "eagle3", "dflash"), "k",
"prompts" (token ids per prompt, already rendered with the chat template), "max_new_tokens",
"temperature", "seed", "dtype", "max_model_len", "warmup", "logprobs" (2: return top-2 gaps),
"plain" (false: skip plain decoding), "engine" (vllm_args.py: tensor / pipeline parallel sizes, expert parallel,
memory, trust_remote_code; beside this file)}.
Result: {"vllm_version", "plain": RUN, "spec": RUN (with a drafter)}, RUN = {"outputs" (token ids per
prompt), "seconds" (per prompt), "load_seconds", "margins" (top-1 minus top-2 logprob per token, with
logprobs), "spec" (per prompt: drafts, draft_tokens, accepted, accepted_per_pos from vLLM's own counters, and
per_step_accepted / per_step_drafted from its per-request metrics)},
or {"error": {"type", "message", "full_message", "traceback"}} with exit status 3.
Prompts run one at a time (batch size 1, the latency speculative decoding is for). With both engines in the
request, each prompt's plain and speculative runs go back to back in alternating order, as `eagle3-hf evaluate`
times them; a request for one engine (no drafter, or "plain": false) is how `evaluate` runs them one after the
other, each process's exit freeing its engine's memory for the next.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

METRIC = "vllm:spec_decode_"


def spec_counters(llm: LLM) -> dict:
    """vLLM's cumulative speculative-decoding counters, summed over label sets."""
    totals: dict = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                    "num_accepted_tokens_per_pos": []}
    for metric in llm.get_metrics():
        if not metric.name.startswith(METRIC):
            continue
        key = metric.name[len(METRIC):].removesuffix("_total")
        if key not in totals:
            continue
        if isinstance(totals[key], list):
            values = list(getattr(metric, "values", []))
            grown = totals[key] + [0] * (len(values) - len(totals[key]))
            totals[key] = [a + int(b) for a, b in zip(grown, values + [0] * (len(grown) - len(values)))]
        else:
            totals[key] += int(metric.value)
    return totals


def delta(after: dict, before: dict) -> dict:
    """Per-prompt counters: the difference of two cumulative snapshots."""
    per_pos_before = before["num_accepted_tokens_per_pos"]
    per_pos = [a - (per_pos_before[i] if i < len(per_pos_before) else 0)
               for i, a in enumerate(after["num_accepted_tokens_per_pos"])]
    return {"drafts": after["num_drafts"] - before["num_drafts"],
            "draft_tokens": after["num_draft_tokens"] - before["num_draft_tokens"],
            "accepted": after["num_accepted_tokens"] - before["num_accepted_tokens"],
            "accepted_per_pos": per_pos}


def _gap(entry: dict[int, Any] | None) -> float | None:
    """Top-1 minus top-2 logprob of one position ({token id: Logprob}); None when fewer than two came back."""
    top = sorted((lp.logprob for lp in (entry or {}).values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else None


def _cpu() -> bool:
    """vLLM's CPU backend: eager there (the project's tests), CUDA graphs on a GPU (as users serve)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def run(request: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm_args import llm_kwargs  # this directory (the script's own, on sys.path)

    engine = dict(request.get("engine") or {})
    engine.setdefault("trust_remote_code", bool(request.get("trust_remote_code", False)))
    common = dict(model=request["verifier"], revision=request.get("verifier_revision"),
                  dtype=request.get("dtype", "float32"), disable_log_stats=False,
                  seed=int(request.get("seed", 0)), max_model_len=int(request.get("max_model_len", 2048)),
                  **llm_kwargs(engine, cpu=_cpu()))
    engines: dict[str, LLM] = {}
    load_seconds: dict[str, float] = {}
    modes = (["plain"] if request.get("plain", True) else []) + (["spec"] if request.get("drafter") else [])
    for mode in modes:  # both engines (when asked for) live in this process (in-process engine core), so each
        start = time.perf_counter()  # prompt's two runs are timed back to back under the same machine load
        kwargs: dict[str, Any] = {}
        if mode == "spec":
            speculative: dict[str, Any] = {"method": request["method"], "model": request["drafter"],
                                           "num_speculative_tokens": int(request["k"])}
            if request.get("drafter_revision"):
                speculative["revision"] = request["drafter_revision"]
            kwargs["speculative_config"] = speculative
            kwargs["per_request_spec_decode_metrics"] = "detailed"  # accepted drafts per verify step
        engines[mode] = LLM(**common, **kwargs)
        load_seconds[mode] = time.perf_counter() - start
    temperature = float(request.get("temperature", 0.0))

    def params(index: int) -> SamplingParams:
        return SamplingParams(max_tokens=int(request["max_new_tokens"]), temperature=temperature,
                              seed=None if temperature <= 0 else int(request.get("seed", 0)) + 7919 * index,
                              detokenize=False, logprobs=request.get("logprobs"))

    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in request["prompts"]]
    if prompts and request.get("warmup", True):  # untimed, as evaluate's warm-up
        for llm in engines.values():
            warm = params(0)
            warm.max_tokens = 8  # the timed calls' own settings (logprobs too), so no first-call cost is timed
            llm.generate(prompts[:1], warm, use_tqdm=False)
    runs: dict[str, dict[str, Any]] = {mode: {"outputs": [], "seconds": [], "margins": [], "spec": []}
                                       for mode in modes}
    for index, prompt in enumerate(prompts):
        for mode in modes if index % 2 == 0 else modes[::-1]:  # alternating order, as evaluate does
            llm, out = engines[mode], runs[mode]
            before = spec_counters(llm)  # the counters are process-wide: take them around this call only
            t0 = time.perf_counter()
            result = llm.generate([prompt], params(index), use_tqdm=False)[0].outputs[0]
            out["seconds"].append(time.perf_counter() - t0)
            out["outputs"].append(list(result.token_ids))
            if request.get("logprobs"):  # top-1 minus top-2 logprob per token: tells numerical ties apart
                out["margins"].append([_gap(entry) for entry in result.logprobs or []])
            if mode == "spec":
                counts = delta(spec_counters(llm), before)
                steps = getattr(result, "spec_decode_metrics", None)
                counts["per_step_accepted"] = list(getattr(steps, "per_step_accepted", None) or [])
                counts["per_step_drafted"] = list(getattr(steps, "per_step_drafted", None) or [])
                out["spec"].append(counts)
    for mode, out in runs.items():
        out["load_seconds"] = load_seconds[mode]
        out["margins"] = out["margins"] or None
        out["spec"] = out["spec"] if mode == "spec" else None
    return {"vllm_version": vllm.__version__, **runs}


def error_result(exc: BaseException) -> dict:
    """The failure as the caller reads it (vllm_env.py): one line to print, the whole text and the traceback
    to show when asked. The extraction runner and the feature server, beside this file, report the same way."""
    message = str(exc).strip().splitlines()
    return {"error": {"type": type(exc).__name__, "message": message[0] if message else "",
                      "full_message": str(exc), "traceback": traceback.format_exc()}}


def request_main(argv: list[str], run: Callable[[dict], dict], usage: str | None,
                 passes: tuple[type[BaseException], ...] = ()) -> int:
    """The command line of the runners that answer one request (this one, vllm_extract_runner.py):
    REQUEST.json RESULT.json; the result, or the error as the caller reads it, with exit status 3. An exception
    of a type in `passes` is the runner's own to handle (raised, nothing written)."""
    if len(argv) != 2:
        print(usage, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        request = json.load(f)
    try:
        result, status = run(request), 0
    except passes:
        raise
    except BaseException as exc:  # the caller turns it into one line; the traceback travels with it
        result, status = error_result(exc), 3
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return status


def main(argv: list[str]) -> int:
    return request_main(argv, run, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
