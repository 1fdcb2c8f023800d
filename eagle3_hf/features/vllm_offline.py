"""`eagle3-hf extract --engine vllm`: the features of a prepared dataset, captured by vLLM, in our shard format.

The engine that will serve the drafter computes the states it is trained on. vLLM (its own venv,
engines/vllm_extract_runner.py) prefills each sample's token ids once (max_tokens=1) with its
`extract_hidden_states` method at ids = the aux indices + [N]: vLLM's id k < N is transformers'
`output_hidden_states` index k (the residual stream entering layer k), and id N is the last layer's output
*before* the final norm. So the aux states are stored as vLLM wrote them, and here, in this venv, the
verifier's own final norm turns id N into `last_hidden_state` (post-norm, as our shards define it) and its
own `lm_head` (with its soft-cap) gives `verifier_greedy`: the same functions `import-features` uses
(verifier/head.load_verifier_head, capture.greedy_tokens). Only the norm and the head are read from the
checkpoint, never the body. vLLM's runner only writes files; each is checked (token ids, rows, layers,
hidden size, finite), taken into a shard and deleted at once.

Same shards, keys, dtypes, checksums, manifest and resumption as `extract` (store.ShardWriter); the
manifest's `source` is "vllm". Ranks (RANK / WORLD_SIZE) split the samples as `extract` does, each with
its own vLLM instance.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..data.prepared_format import open_prepared, prepared_lengths
from ..verifier.capture import greedy_tokens
from ..verifier.family import check_aux_indices, default_aux_indices, logit_softcap
from ..verifier.head import load_verifier_head
from .store import ShardWriter, canonical_dtype, dist_env, make_header, wait_and_merge

if TYPE_CHECKING:
    import datasets

    from .vllm_server import EndpointExtraction

SOURCE = "vllm"
ENDPOINT_TIMEOUT_S = 600.0  # one completion (and its file) from a running server; --vllm-timeout overrides


def vllm_layer_ids(aux_indices: Sequence[int], num_layers: int) -> list[int]:
    """What vLLM is asked to capture: the aux indices (same numbers in vLLM) and N, ascending (vLLM sorts)."""
    indices = check_aux_indices(aux_indices, num_layers)
    return sorted(indices) + [num_layers]


def checkpoint_dtype(path: str | Path) -> str:
    """The dtype a checkpoint's config.json names ("auto" when none): what transformers' dtype="auto" loads.
    vLLM's own "auto" runs a float32 checkpoint in bfloat16 on the CPU, so `--torch-dtype auto` is resolved
    here to mean the same in both engines; pass bfloat16 to get what vLLM serves by default."""
    import json

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return "auto"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for where in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(where.get(key), str):
                return str(where[key])
    return "auto"


def read_states(path: str | Path, sample_id: str, input_ids: torch.Tensor, layer_ids: list[int],
                hidden: int) -> torch.Tensor:
    """One file vLLM's connector wrote -> its hidden_states [T, len(layer_ids), H] as float32, checked.

    ValueError (one line naming the file and the sample) when its token_ids are not the sample's, its rows
    differ from its token_ids (what prefix caching does, vLLM issue 44485), its layer or hidden size is not
    the one asked for, or a state is NaN/Inf.
    """
    from safetensors.torch import load_file

    try:
        data = load_file(str(path))
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"{path}: not a readable hidden-states file for sample {sample_id!r}: {exc}") from None
    return check_states(data, str(path), sample_id, input_ids, layer_ids, hidden)


def check_states(data: dict[str, torch.Tensor], path: str, sample_id: str, input_ids: torch.Tensor,
                 layer_ids: list[int], hidden: int) -> torch.Tensor:
    """read_states' checks on tensors already loaded (`path` names where they came from: a file, a server)."""
    for key in ("hidden_states", "token_ids"):
        if key not in data:
            raise ValueError(f"{path}: no {key!r} tensor (sample {sample_id!r}); found {sorted(data)}")
    states, tokens = data["hidden_states"], data["token_ids"]
    if not torch.equal(tokens.long(), input_ids.long()):
        raise ValueError(f"{path}: its token_ids ({tokens.numel()}) are not sample {sample_id!r}'s input_ids "
                         f"({input_ids.numel()})")
    if states.dim() != 3 or states.shape[0] != tokens.shape[0]:
        raise ValueError(f"{path}: hidden_states has shape {tuple(states.shape)} but token_ids has {tokens.shape[0]} "
                         f"rows (sample {sample_id!r}); with prefix caching vLLM saves fewer rows: it must be off")
    if states.shape[1:] != (len(layer_ids), hidden):
        raise ValueError(f"{path}: hidden_states holds {states.shape[1]} layers x {states.shape[2]} for sample "
                         f"{sample_id!r}, expected {len(layer_ids)} (vLLM ids {layer_ids}) x hidden {hidden}")
    states = states.float()
    finite = torch.isfinite(states).all(dim=(0, 2))
    if not finite.all():
        bad = [layer_ids[j] for j in range(len(layer_ids)) if not finite[j]]
        raise ValueError(f"{path}: non-finite hidden states for sample {sample_id!r} at vLLM layer ids {bad}")
    return states


@torch.no_grad()
def features_from_states(states: torch.Tensor, aux_indices: Sequence[int], layer_ids: list[int], norm: nn.Module,
                         head: nn.Module, softcap: float | None) -> dict[str, torch.Tensor]:
    """vLLM's [T, layers, H] -> our aux_hidden_states [T, 3H] (in aux order), last_hidden_state [T, H]
    (the final norm applied once to vLLM's id N) and verifier_greedy [T]."""
    slot = {lid: j for j, lid in enumerate(layer_ids)}
    aux = torch.cat([states[:, slot[int(i)]] for i in aux_indices], dim=-1)
    last = norm(states[:, slot[layer_ids[-1]]])  # vLLM's id N is before the final norm
    return {"aux_hidden_states": aux, "last_hidden_state": last,
            "verifier_greedy": greedy_tokens(head, last, softcap)}


class VllmFeatureSpec:
    """What an extraction through vLLM needs on this side, whoever drives the engine (`extract --engine vllm`,
    `regenerate --engine vllm`): the verifier's path, its final norm and head, the aux indices and vLLM's layer
    ids, the shard header (source "vllm", its provenance) and vLLM's dtype."""

    def __init__(self, verifier: str, tokenizer_fingerprint: str, aux_indices: Sequence[int] | None = None,
                 dtype: str = "bfloat16", verifier_name: str | None = None, verifier_revision: str | None = None,
                 vllm_dtype: str = "auto"):
        from ..verifier.loading import resolve_verifier

        self.path = resolve_verifier(str(verifier))
        self.revision = verifier_revision
        self.norm, self.head, config = load_verifier_head(self.path, verifier_revision)
        self.vllm_dtype = checkpoint_dtype(self.path) if vllm_dtype == "auto" else vllm_dtype
        self.num_layers, self.hidden = int(config.num_hidden_layers), int(config.hidden_size)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.indices = check_aux_indices(aux_indices or default_aux_indices(self.num_layers), self.num_layers)
        self.layer_ids = vllm_layer_ids(self.indices, self.num_layers)
        self.softcap = logit_softcap(config)
        info = {"name": str(verifier_name or verifier), "revision": verifier_revision,
                "num_hidden_layers": self.num_layers, "hidden_size": self.hidden, "vocab_size": int(config.vocab_size)}
        provenance = {"engine": "vllm", "vllm_layer_ids": self.layer_ids, "vllm_dtype": self.vllm_dtype,
                      "last_hidden_state": f"the verifier's final norm applied to vLLM's id {self.num_layers} "
                                           "(pre-norm)",
                      "verifier_greedy": "argmax of the verifier's lm_head (with its soft-cap) on last_hidden_state"}
        self.header = make_header(info, tokenizer_fingerprint, self.indices, canonical_dtype(dtype), source=SOURCE,
                                  provenance=provenance)
        self.next_token_checks = self.next_token_agreements = 0  # a server's own tokens (check_next_token)

    def request(self, max_model_len: int, batch_size: int = 8, max_pending: int = 16, tensor_parallel_size: int = 1,
                connector: str = "auto") -> dict[str, Any]:
        """The runner's request (vllm_extract_runner.py) for this verifier."""
        return {"verifier": self.path, "verifier_revision": self.revision, "dtype": self.vllm_dtype,
                "max_model_len": int(max_model_len), "layer_ids": self.layer_ids, "batch_size": batch_size,
                "max_pending": max_pending, "tensor_parallel_size": tensor_parallel_size, "connector": connector}

    def write(self, records: Iterable[dict[str, Any]], rows: Any, all_ids: list[str], submit: list[int],
              writer: ShardWriter, bar: Any) -> None:
        """Each file vLLM reports -> checked, mapped, into a shard, deleted (a kill before its commit redoes it).
        `submit[key]` is the row of the dataset `rows` the record's key names. Records from a server carry its
        next token: the first samples are held back until those tokens vouch for the layers (check_next_token,
        refuse_unvouched), so that a misconfigured server never leaves a shard behind."""
        held: list[tuple[str, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = []
        for record in records:
            i = submit[int(record["key"])]
            row, sample_id = rows[i], all_ids[i]
            input_ids = row["input_ids"].long()
            states = read_states(record["path"], sample_id, input_ids, self.layer_ids, self.hidden)
            feats = features_from_states(states, self.indices, self.layer_ids, self.norm, self.head, self.softcap)
            os.unlink(record["path"])
            held.append((sample_id, input_ids, row["loss_mask"], feats))
            if record.get("next_token") is not None and not self.vouched:
                self.check_next_token(int(record["next_token"]), int(feats["verifier_greedy"][-1]), sample_id)
                if not self.vouched:
                    continue
            self._add(held, writer, bar)
        if held:  # fewer samples than PROBE from a server, none of whose next tokens agreed
            self.refuse_unvouched(held[-1][0])

    @staticmethod
    def _add(held: list, writer: ShardWriter, bar: Any) -> None:
        for sample_id, input_ids, loss_mask, feats in held:
            writer.add(sample_id, input_ids, loss_mask, feats["aux_hidden_states"], feats["last_hidden_state"],
                       feats["verifier_greedy"])
            bar.update(input_ids.numel())
        held.clear()

    @property
    def vouched(self) -> bool:
        """Whether a server's own next tokens have agreed with the captured states at least once."""
        return self.next_token_agreements > 0

    def check_next_token(self, served: int, greedy: int, sample_id: str) -> None:
        """A server's own next token against the greedy token of the state it saved last (vLLM's id N, normed
        here): they agree unless the server captures other layers or norms differently. All of the first
        PROBE disagreeing stops the run, nothing written (a near-tie flips one, not four); with fewer samples
        than PROBE, `refuse_unvouched` after the last."""
        from .vllm_server import PROBE

        self.next_token_checks += 1
        self.next_token_agreements += int(served == greedy)
        if self.next_token_checks == PROBE:
            self.refuse_unvouched(sample_id)

    def refuse_unvouched(self, sample_id: str) -> None:
        """Stop the run (EndpointError, naming `sample_id`, the last sample checked) unless a server's next token
        has agreed at least once: after PROBE checks, or when the records end with samples still held."""
        from .vllm_server import EndpointError

        if self.next_token_agreements == 0:
            raise EndpointError(f"the server's next token differs from the verifier's greedy token on its last saved "
                                f"state for all of the first {self.next_token_checks} samples (last {sample_id!r}): "
                                f"it does not capture vLLM layer ids {self.layer_ids} of this verifier (start it with "
                                "`eagle3-hf serve-vllm`)")


def extract_features_vllm(
    verifier: str,
    tokenizer_fingerprint: str,
    prepared_dataset: datasets.Dataset | str | Path,
    out_dir: str | Path,
    aux_indices: Sequence[int] | None = None,
    dtype: str = "bfloat16",
    samples_per_shard: int = 64,
    max_shard_bytes: int = 1 << 30,
    verifier_name: str | None = None,
    verifier_revision: str | None = None,
    vllm_dtype: str = "auto",
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    batch_size: int = 8,
    max_pending: int = 16,
    threads: int = 1,
    timeout: float | None = None,
    connector: str = "auto",
    debug: bool = False,
    progress: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    endpoint: str | None = None,
    vllm_storage: str | None = None,
) -> dict[str, Any]:
    """Write vLLM's features for this rank's slice of `prepared_dataset` to `out_dir`; returns a summary.
    With `endpoint`, a running vLLM OpenAI server computes them (features/vllm_server.py; `batch_size`
    requests in flight), and no vLLM is needed here; the summary's "connector" is then None (the server's
    answers do not name it)."""
    from tqdm.auto import tqdm

    from ..engines.vllm_env import VllmExtraction, vllm_python

    if endpoint is None:
        vllm_python()  # vLLM missing: one line, before anything is written
    env_rank, env_world = dist_env()
    rank = env_rank if rank is None else rank
    world_size = env_world if world_size is None else world_size
    out_dir = Path(out_dir)
    spec = VllmFeatureSpec(verifier, tokenizer_fingerprint, aux_indices, dtype, verifier_name, verifier_revision,
                           vllm_dtype)
    ds = open_prepared(prepared_dataset, tokenizer_fingerprint)
    all_ids = list(ds["id"])
    mine = range(rank, len(ds), world_size)
    lengths = prepared_lengths(ds)
    longest = max((lengths[i] for i in mine), default=0)  # checked before anything is written, done ones included
    if max_model_len is not None and longest + 1 > max_model_len:
        raise ValueError(f"--max-model-len {max_model_len}: the longest sample has {longest} tokens (+1 generated)")
    served = None
    if endpoint is not None:
        from .vllm_server import check_server

        served = check_server(endpoint, verifier, spec.path, longest, spec.layer_ids, vllm_storage)
    writer = ShardWriter(out_dir, spec.header, rank=rank, samples_per_shard=samples_per_shard,
                         max_shard_bytes=max_shard_bytes)
    todo = [i for i in mine if all_ids[i] not in writer.done_ids]
    rows = ds.with_format("torch", columns=["input_ids", "loss_mask"])
    submit = [i for i in todo if lengths[i] > 0]
    request = spec.request(int(max_model_len or max((lengths[i] for i in submit), default=0) + 1), batch_size,
                           max_pending, tensor_parallel_size, connector)
    bar = tqdm(total=int(sum(lengths[i] for i in submit)), unit="tok", unit_scale=True, desc=f"extract vllm r{rank}",
               disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    vllm_result: dict[str, Any] = {}
    peak = 0
    try:
        for i in todo:
            if lengths[i] == 0:
                writer.skip(all_ids[i], "empty")
        if submit:
            prompts = ((k, rows[i]["input_ids"].tolist()) for k, i in enumerate(submit))
            run: VllmExtraction | EndpointExtraction
            if served is not None:
                from .vllm_server import EndpointExtraction

                run = EndpointExtraction(str(endpoint), prompts, model=str(served["id"]), concurrency=batch_size,
                                         timeout=ENDPOINT_TIMEOUT_S if timeout is None else timeout,
                                         storage=served["storage"])
            else:
                run = VllmExtraction(request, prompts, threads=threads, debug=debug, timeout=timeout)
            with run:
                spec.write(run.records(), rows, all_ids, submit, writer, bar)
                vllm_result = run.result or {}
                peak = run.peak_pending_bytes
    finally:
        writer.close()
        bar.close()
    elapsed = time.perf_counter() - start
    summary = {"engine": "vllm", "vllm_version": vllm_result.get("vllm_version"), "vllm_dtype": spec.vllm_dtype,
               "connector": vllm_result.get("connector"), "rank": rank, "world_size": world_size,
               "written_samples": writer.written_samples, "written_tokens": writer.written_tokens,
               "resumed_past": len(mine) - len(todo), "skipped": dict(writer.skipped_counts),
               "seconds": round(elapsed, 3), "vllm_load_seconds": vllm_result.get("load_seconds"),
               "tokens_per_s": round(writer.written_tokens / elapsed, 1) if elapsed > 0 else None,
               "peak_temporary_bytes": peak}
    if endpoint is not None:
        summary.update(endpoint=endpoint, next_token_agreement=round(spec.next_token_agreements
                                                                     / max(spec.next_token_checks, 1), 4))
    if rank == 0:
        manifest = wait_and_merge(out_dir, all_ids, 48 * 3600)
        summary.update(total_samples=len(manifest["samples"]), total_skipped=manifest["skipped"])
    return summary
