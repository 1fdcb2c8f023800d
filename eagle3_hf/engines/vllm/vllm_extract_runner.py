"""Extract hidden states with vLLM: prefill each prompt, let the connector write its states, report each file.

Runs inside the vLLM venv, executed by path (standard library, torch and vllm; never eagle3_hf), like
vllm_runner.py. vLLM's `extract_hidden_states` speculative method caches the requested layer ids (an id k
is the residual stream entering layer k; id N, the layer count, is the last layer's output *before* the
final norm), and a hidden-states connector writes one safetensors file per finished request:
`hidden_states` [T, len(ids), hidden] in ascending id order, `token_ids` [T]. On CUDA that is vLLM's stock
`ExampleHiddenStatesConnector`; on the CPU backend our `CpuHiddenStatesConnector` (vllm_hidden_states.py,
next to this file), whose write does not need CUDA.

    python vllm_extract_runner.py REQUEST.json RESULT.json

Request: {"verifier", "verifier_revision", "dtype", "max_model_len", "layer_ids" (ascending), "storage" (the
connector's directory), "prompts_file" (JSONL, one {"key", "ids"} per line), "progress_file" (JSONL this
runner appends to), "batch_size", "max_pending" (files written and not yet taken by the reader: the
runner waits before its next batch while more lie in storage; default 2 x batch_size), "engine" (vllm_args.py:
tensor / pipeline parallel sizes, expert parallel, memory, trust_remote_code), "seed", "connector" ("auto", "cpu"
or "stock"), "starter_pid" (the reader's pid; default the parent's)}.
The request file's directory is this run's own (VllmExtraction's temporary directory): a runner whose reader
has exited (killed) removes it, files included, and stops at its next batch.
Each prompt runs prefill only (max_tokens=1, greedy): its line in the progress file is {"key", "path",
"prompt_tokens"}, appended once the file is complete. Prefix caching is off (with it vLLM can save fewer
rows than tokens) and chunked prefill too (one prefill per prompt). Result: {"vllm_version", "connector",
"samples", "load_seconds", "seconds"}, or {"error": {...}} with exit status 3, as vllm_runner.py.

Generate phase (`regenerate --engine vllm`): a request with "generate" ({"max_tokens", "temperature", "top_p",
"stop_token_ids", "chunk"}) first answers rounds of prompts through the same engine, then prefills as above.
The reader writes round n as `generate_NNNN.jsonl` ({"key", "ids", "seed"} per line) next to the request,
renamed into place whole; the runner answers each prompt with a progress line {"round", "key",
"output_ids", "finish_reason"} (the states of these requests are not saved: NO_SAVE, or the stock
connector's file deleted). The prompts file appearing ends the rounds (the reader renders the answers into
prepared samples meanwhile, in its own process). "extract": false loads vLLM without the speculative method
and the connector (plain generation, prefix caching on as vLLM's default: the bench's baseline) and runs
the rounds only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_CONNECTOR_MODULE = "vllm_hidden_states"  # this directory is on sys.path (the script's own directory)


def connector_config(storage: str, choice: str = "auto") -> dict:
    """vLLM's kv_transfer_config: the stock connector where CUDA is present, ours otherwise."""
    import torch

    stock = choice == "stock" or (choice == "auto" and torch.cuda.is_available())
    config = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": storage,
                                            # offline: the file is complete when generate() returns it
                                            "use_synchronization_lock": stock}}
    if not stock:
        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        config.update(kv_connector="CpuHiddenStatesConnector", kv_connector_module_path=CPU_CONNECTOR_MODULE)
    return config


def read_prompts(path: str) -> Iterator[Any]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


class ReaderGone(RuntimeError):
    """The reader that started this runner has exited (killed): nobody takes the files or reads the result."""


def process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped: a container without an init) counts as gone.
    Here, not in vllm_env.py, because the feature server (vLLM venv) needs it too and imports only this file."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Starter:
    """The process that started this runner (the request's "starter_pid"): its parent when the runner is a
    fresh process (then its exit shows as a new parent, which a reused pid cannot fake), or any other process when
    the runner was forked from the warm vLLM process (engines/fork_server.py: the parent is that process; then the pid
    itself is watched)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = int(pid or os.getppid())
        self.forked = os.getppid() != self.pid

    def alive(self) -> bool:
        return process_alive(self.pid) if self.forked else os.getppid() == self.pid


def reader_gone(storage: str, parent: Starter) -> bool:
    """True (and this runner's files removed) once the reader that started it has exited: killed, nobody
    will take or delete them, and the temporary directory must not fill the disk."""
    if parent.alive():
        return False
    for name in os.listdir(storage):
        if name.endswith((".safetensors", ".partial", ".lock")):
            try:
                os.remove(os.path.join(storage, name))
            except FileNotFoundError:
                pass
    return True


def wait_for_room(storage: str, max_pending: int, parent: Starter) -> None:
    """Back-pressure: the reader deletes each file once a shard holds it; wait while too many lie here."""
    while True:
        if reader_gone(storage, parent):
            raise ReaderGone("the reader process exited; stopped and removed the files it had not taken")
        pending = sum(1 for name in os.listdir(storage) if name.endswith(".safetensors"))
        if pending <= max_pending:
            return
        time.sleep(0.02)


def wait_written(llm: LLM, path: str, stock: bool, in_process: bool, timeout_s: float = 600.0) -> None:
    """Until the connector has written `path`. A finished request's save runs at the engine's next step,
    after generate() returned it: the in-process engine is stepped here (a step with nothing scheduled
    only flushes the pending saves); an engine in its own process steps by itself. The stock connector
    writes in a thread and holds an exclusive lock on PATH.lock until the file is whole."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM did not write {path} within {timeout_s:.0f} s")
        if in_process:
            llm.llm_engine.step()
        else:
            time.sleep(0.01)
    lock = path + ".lock"
    if stock and os.path.exists(lock):
        import fcntl

        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the writer thread releases LOCK_EX
        os.remove(lock)


def load_llm(request: dict, storage: str, layer_ids: list[int]) -> tuple[LLM, dict]:
    """vLLM with extract_hidden_states at `layer_ids` and the hidden-states connector writing to `storage`
    (prefill only: prefix caching and chunked prefill off). Also the feature server's engine
    (vllm_feature_server.py). Returns (llm, kv_transfer_config)."""
    from vllm import LLM

    if layer_ids != sorted(set(layer_ids)):
        raise ValueError(f"layer ids must be distinct and ascending (vLLM stores them sorted): {layer_ids}")
    kv_config = connector_config(storage, request.get("connector", "auto"))
    llm = LLM(model=request["verifier"], revision=request.get("verifier_revision"),
              dtype=request.get("dtype", "auto"), seed=int(request.get("seed", 0)),
              max_model_len=int(request["max_model_len"]), enable_prefix_caching=False,
              enable_chunked_prefill=False, **engine_kwargs(request),
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": layer_ids}}},
              kv_transfer_config=kv_config)
    return llm, kv_config


def plain_llm(request: dict) -> LLM:
    """vLLM as it generates without extraction (no speculative method, no connector, its own caching)."""
    from vllm import LLM

    return LLM(model=request["verifier"], revision=request.get("verifier_revision"),
               dtype=request.get("dtype", "auto"), seed=int(request.get("seed", 0)),
               max_model_len=int(request["max_model_len"]), **engine_kwargs(request))


def engine_kwargs(request: dict) -> dict:
    """The request's engine options (vllm_args.py: TP, PP, expert parallel, memory, remote code) as LLM keyword
    arguments; enforce_eager only on vLLM's CPU backend."""
    from vllm.platforms import current_platform
    from vllm_args import llm_kwargs  # this directory (on sys.path: HERE)

    engine = dict(request.get("engine") or {})
    engine.setdefault("tensor_parallel_size", int(request.get("tensor_parallel_size", 1)))
    return llm_kwargs(engine, cpu=current_platform.is_cpu())


def generation_params(gen: dict, seed: Any, extract: bool) -> Any:
    """The answer's sampling (regenerate's options; a per-prompt seed, so batching never changes a sample);
    with the connector on, the request is flagged so that its prompt states are not written."""
    from vllm import SamplingParams
    from vllm_hidden_states import NO_SAVE  # this script's own directory (sys.path[0])

    return SamplingParams(max_tokens=int(gen["max_tokens"]), temperature=float(gen.get("temperature", 0.0)),
                          top_p=float(gen.get("top_p", 1.0)), seed=None if seed is None else int(seed),
                          stop_token_ids=[int(t) for t in gen.get("stop_token_ids") or []], detokenize=False,
                          extra_args={"kv_transfer_params": {NO_SAVE: True}} if extract else None)


def wait_for_file(path: str, other: str, storage: str, parent: Starter) -> bool:
    """Until `path` or `other` exists (the reader writes either); True for `path`. Stops if the reader is gone."""
    while True:
        if os.path.exists(path):
            return True
        if os.path.exists(other):
            return False
        if reader_gone(storage, parent):
            raise ReaderGone("the reader process exited; stopped and removed the files it had not taken")
        time.sleep(0.02)


def generate_rounds(llm: LLM, request: dict, progress: Any, parent: Starter, stock: bool, in_process: bool,
                    extract: bool) -> int:
    """The generate phase: answer each round file the reader writes, until the prompts file appears.
    Returns the tokens generated."""
    from vllm.inputs import TokensPrompt

    gen, storage, prompts_file = request["generate"], request["storage"], request["prompts_file"]
    directory = os.path.dirname(os.path.abspath(prompts_file))
    chunk = max(1, int(gen.get("chunk", 256)))
    n = tokens = 0
    while wait_for_file(os.path.join(directory, f"generate_{n:04d}.jsonl"), prompts_file, storage, parent):
        items = list(read_prompts(os.path.join(directory, f"generate_{n:04d}.jsonl")))
        for start in range(0, len(items), chunk):
            part = items[start:start + chunk]
            outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p["ids"])) for p in part],
                                   [generation_params(gen, p.get("seed"), extract) for p in part], use_tqdm=False)
            for p, out in zip(part, outputs):
                saved = (out.kv_transfer_params or {}).get("hidden_states_path")
                if saved:  # the stock connector saves every request: these states are never read
                    wait_written(llm, saved, stock, in_process)
                    os.remove(saved)
                answer = out.outputs[0]
                tokens += len(answer.token_ids)
                progress.write(json.dumps({"round": n, "key": p["key"], "output_ids": list(answer.token_ids),
                                           "finish_reason": answer.finish_reason}) + "\n")
            progress.flush()
            if reader_gone(storage, parent):
                raise ReaderGone("the reader process exited; stopped and removed the files it had not taken")
        n += 1
    return tokens


def prefill_params() -> Any:
    """One greedy token, no detokenization: the prompt's prefill is what writes its states."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


def run(request: dict) -> dict:
    import vllm
    from vllm.inputs import TokensPrompt

    storage = request["storage"]
    os.makedirs(storage, exist_ok=True)
    layer_ids = [int(i) for i in request["layer_ids"]]
    start = time.perf_counter()
    extract = bool(request.get("extract", True))
    if extract:
        llm, kv_config = load_llm(request, storage, layer_ids)
    else:
        llm, kv_config = plain_llm(request), {"kv_connector": None}
    load_seconds = time.perf_counter() - start
    stock = kv_config["kv_connector"] == "ExampleHiddenStatesConnector"
    in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
    params = prefill_params()
    parent = Starter(request.get("starter_pid"))
    batch_size = int(request.get("batch_size", 8))
    max_pending = int(2 * batch_size if request.get("max_pending") is None else request["max_pending"])
    done, generated, t0, generate_seconds = 0, 0, time.perf_counter(), 0.0
    with open(request["progress_file"], "a", encoding="utf-8") as progress:
        if request.get("generate"):
            generated = generate_rounds(llm, request, progress, parent, stock, in_process, extract)
            generate_seconds = time.perf_counter() - t0
        if not extract:
            wait_for_file(request["prompts_file"], request["prompts_file"], storage, parent)
        batch: list[dict] = []
        prompts = read_prompts(request["prompts_file"]) if extract else iter(())
        while True:
            item = next(prompts, None)
            if item is not None:
                batch.append(item)
                if len(batch) < batch_size:
                    continue
            if not batch:
                break
            wait_for_room(storage, max_pending, parent)
            outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p["ids"])) for p in batch], params,
                                   use_tqdm=False)
            for prompt, out in zip(batch, outputs):
                path = (out.kv_transfer_params or {}).get("hidden_states_path")
                if not path:
                    raise RuntimeError("vLLM returned no hidden_states_path: is the extract_hidden_states "
                                       "connector configured?")
                wait_written(llm, path, stock, in_process)
                progress.write(json.dumps({"key": prompt["key"], "path": path,
                                           "prompt_tokens": len(out.prompt_token_ids or [])}) + "\n")
            progress.flush()
            done += len(batch)
            batch = []
            if item is None:
                break
    if reader_gone(storage, parent):  # killed during the last batch: nobody reads the result either
        raise ReaderGone("the reader process exited; removed the files it had not taken")
    return {"vllm_version": vllm.__version__, "connector": kv_config["kv_connector"], "samples": done,
            "generated_tokens": generated, "generate_seconds": generate_seconds,
            "load_seconds": load_seconds, "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    from vllm_runner import request_main  # this directory: the script's own (sys.path[0])

    try:
        return request_main(argv, run, __doc__, passes=(ReaderGone,))
    except ReaderGone:  # its temporary directory (request, prompts, progress, log) would outlive it otherwise
        import shutil

        shutil.rmtree(os.path.dirname(os.path.abspath(argv[0])), ignore_errors=True)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
