"""A hidden-states connector for vLLM's CPU build, loaded by vLLM itself (`kv_connector_module_path`).

Runs inside the vLLM venv only (standard library, torch, safetensors and vllm; never eagle3_hf). vLLM 0.32's
`extract_hidden_states` speculative method caches the requested layers' states of every scheduled token in a
cache-only attention layer ([blocks, layers, block_size, hidden]); its `ExampleHiddenStatesConnector`
gathers a finished request's slots and writes `{hidden_states [T, layers, hidden], token_ids [T]}` to one
safetensors file per request. Its write path copies through a CUDA stream into pinned memory and fails on
the CPU backend (`RuntimeError: pin_memory=True requires a CUDA or other accelerator backend`). This
subclass gathers the same slots and writes the file synchronously, before the request is reported done,
so the file is complete when `LLM.generate` returns the request. With CUDA present the stock connector is
used (vllm_extract_runner.py chooses); everything else (which slots, file names, `token_ids`, the
one-file-per-request protocol) is vLLM's own, inherited unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

CLASS_NAME = "CpuHiddenStatesConnector"
# a request whose kv_transfer_params hold this key is not saved: `regenerate --engine vllm` generates its answers
# through the extraction engine, and those prompts' states are never read (the answers are prefilled again)
NO_SAVE = "eagle3_hf_no_save"


class _Written:
    """Stands for the stock connector's CUDA copy event: the write already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose write gathers the request's slots and saves synchronously."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A request flagged NO_SAVE frees its blocks at once and writes nothing; the rest as vLLM's own."""
        if (request.kv_transfer_params or {}).get(NO_SAVE):
            self._request_filenames.pop(request.request_id, None)
            self._pending_saves.pop(request.request_id, None)
            return False, None
        return super().request_finished(request, block_ids)

    def _submit_async_write(self, pending: Any) -> None:  # vLLM's pending-write record
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None:
            raise RuntimeError("hidden-states connector: no cache registered (register_kv_caches never ran)")
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        # fewer slots than tokens (blocks freed or shared early) gives fewer rows; the reader checks rows == T
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).to("cpu").contiguous().clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            tmp = pending.filename + ".partial"
            try:
                save_file(tensors, tmp)
            except BaseException:  # a full disk: no half file left behind; the reader finds the lock free, no file
                if os.path.exists(tmp):
                    os.remove(tmp)
                raise
            os.replace(tmp, pending.filename)  # a reader never sees half a file
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the stock protocol's LOCK_EX for readers waiting on it
        self._req_copy_events[pending.req_id] = _Written()  # get_finished reports it done on this step
