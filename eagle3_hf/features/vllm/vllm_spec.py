"""What every route that runs vLLM shares on this side (`extract --engine vllm`, with an engine of its own or a
running OpenAI server; `regenerate --engine vllm`; the feature server): how vLLM runs (`VllmOptions`), what is
asked of it and how its files become shard samples (`VllmFeatureSpec`, `read_states`), the reader threads and the
checkpoint's dtype. The routes themselves (routes/vllm_offline.py, routes/vllm_server_client.py, whose FeatureSource
is vllm_features.py's; vllm_generation.py) import this, never each other.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...errors import EndpointError, UsageError, debug_requested
from ...verifier.family import check_aux_indices, default_aux_indices, logit_softcap
from ...verifier.head import load_verifier_head
from ..engine_states import PROBE, all_finite, check_states, features_from_states, vllm_layer_ids
from ..interface import PreparedSample, SampleFeatures, SourceIdentity, VerifierIdentity
from ..records import canonical_dtype

SOURCE = "vllm"

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
    """One file vLLM's connector wrote -> its hidden_states [T, len(layer_ids), H] in the dtype vLLM wrote,
    checked. The file is mapped, not copied (safetensors' own loader): its pages are read by the checks and
    the copies that follow.

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


def default_readers() -> int:
    """Reader threads per extraction process: min(4, the CPUs it may use)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class VllmFeatureSpec:
    """What an extraction through vLLM needs on this side, whoever drives the engine (`extract --engine vllm`,
    `regenerate --engine vllm`): the verifier's path, its final norm and head, the aux indices and vLLM's layer
    ids, the shard header (source "vllm", its provenance) and vLLM's dtype."""

    def __init__(self, verifier: str, tokenizer_fingerprint: str, aux_indices: Sequence[int] | None = None,
                 dtype: str = "bfloat16", verifier_name: str | None = None, verifier_revision: str | None = None,
                 vllm_dtype: str = "auto"):
        from ...verifier.loading import resolve_verifier

        self.path = resolve_verifier(str(verifier))
        self.revision = verifier_revision
        self.norm, self.head, config = load_verifier_head(self.path, verifier_revision)
        self.vllm_dtype = checkpoint_dtype(self.path) if vllm_dtype == "auto" else vllm_dtype
        self.num_layers, self.hidden = int(config.num_hidden_layers), int(config.hidden_size)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.indices = check_aux_indices(aux_indices or default_aux_indices(self.num_layers), self.num_layers)
        self.layer_ids = vllm_layer_ids(self.indices, self.num_layers)
        self.softcap = logit_softcap(config)
        who = VerifierIdentity.of(config, str(verifier_name or verifier), verifier_revision, files=self.path)
        provenance = {"engine": "vllm", "vllm_layer_ids": self.layer_ids, "vllm_dtype": self.vllm_dtype,
                      "last_hidden_state": f"the verifier's final norm applied to vLLM's id {self.num_layers} "
                                           "(pre-norm)",
                      "verifier_greedy": "argmax of the verifier's lm_head (with its soft-cap) on last_hidden_state"}
        self.identity = SourceIdentity(who, tokenizer_fingerprint, tuple(self.indices), canonical_dtype(dtype),
                                       SOURCE, provenance)
        self.header = self.identity.header()
        self.next_token_checks = self.next_token_agreements = 0  # a server's own tokens (check_next_token)

    def request(self, max_model_len: int, batch_size: int = 8, max_pending: int | None = None,
                engine: dict[str, Any] | None = None, connector: str = "auto") -> dict[str, Any]:
        """The runner's request (vllm_extract_runner.py) for this verifier. `max_pending` (default 2 x batch): the
        runner starts its next batch only while at most that many files wait for the readers, so the engine
        keeps prefilling while the readers are less than two batches behind."""
        from ...engines.vllm.vllm_args import check_batched_tokens

        check_batched_tokens(dict(engine or {}), max_model_len)
        max_pending = 2 * batch_size if max_pending is None else max_pending
        return {"verifier": self.path, "verifier_revision": self.revision, "dtype": self.vllm_dtype,
                "max_model_len": int(max_model_len), "layer_ids": self.layer_ids, "batch_size": batch_size,
                "max_pending": max_pending, "engine": dict(engine or {}), "connector": connector}

    def features(self, records: Iterable[dict[str, Any]], samples: Sequence[PreparedSample], readers: int = 1
                 ) -> Iterator[SampleFeatures]:
        """Each file vLLM reports -> read, checked, mapped, stored, hashed and deleted (`read_sample`) by one of
        `readers` threads, yielded in the records' order (a kill before its shard's commit redoes it). A record's
        key is its sample's place in `samples`. Records from a server carry its next token: the first samples are
        held back until those tokens vouch for the layers (check_next_token, refuse_unvouched), so that a
        misconfigured server never leaves a shard behind."""
        from ..ordered_pool import ordered_map

        def drop(job: tuple[dict[str, Any], PreparedSample]) -> None:  # reported, never read: delete it as read
            Path(job[0]["path"]).unlink(missing_ok=True)

        def read(job: tuple[dict[str, Any], PreparedSample]) -> tuple[dict[str, Any], SampleFeatures]:
            return job[0], self.read_sample(*job)

        # the sample rows are read here, in this thread (a dataset's rows), the files by the readers
        jobs = ((record, samples[int(record["key"])]) for record in records)
        held: list[SampleFeatures] = []
        for record, feats in ordered_map(read, jobs, readers, on_drop=drop):
            held.append(feats)
            if record.get("next_token") is not None and not self.vouched:
                self.check_next_token(int(record["next_token"]), int(feats.verifier_greedy[-1]),
                                      feats.sample.sample_id)
                if not self.vouched:
                    continue
            yield from held
            held.clear()
        if held:  # fewer samples than PROBE from a server, none of whose next tokens agreed
            self.refuse_unvouched(held[-1].sample.sample_id)

    def read_sample(self, record: dict[str, Any], sample: PreparedSample) -> SampleFeatures:
        """One connector file -> the sample as a shard stores it, with its checksum; the file is deleted once
        read. Works in the file's dtype: the aux states are copied once into the storage dtype, only vLLM's id N
        goes to float32 (for the norm and the greedy head)."""
        from ..records import DTYPES
        from ..store import sample_sha256, stored_sample

        states = read_states(record["path"], sample.sample_id, sample.input_ids, self.layer_ids, self.hidden)
        dtype = self.identity.dtype
        feats = features_from_states(states, self.indices, self.layer_ids, self.norm, self.head, self.softcap,
                                     dtype=None if dtype == "float8_e4m3fn" else DTYPES[dtype])
        del states  # the file's mapping
        os.unlink(record["path"])
        out = SampleFeatures(sample, feats["aux_hidden_states"], feats["last_hidden_state"], feats["verifier_greedy"])
        if not all_finite(feats["last_hidden_state"]):  # a broken norm: the writer skips it, counted, as before
            return out
        out.stored = stored_sample(sample.input_ids, sample.loss_mask, out.aux_hidden_states, out.last_hidden_state,
                                   out.verifier_greedy, dtype)
        out.stored_sha256 = sample_sha256(out.stored)
        return out

    @property
    def vouched(self) -> bool:
        """Whether a server's own next tokens have agreed with the captured states at least once."""
        return self.next_token_agreements > 0

    def check_next_token(self, served: int, greedy: int, sample_id: str) -> None:
        """A server's own next token against the greedy token of the state it saved last (vLLM's id N, normed
        here): they agree unless the server captures other layers or norms differently. All of the first
        PROBE disagreeing stops the run, nothing written (a near-tie flips one, not four); with fewer samples
        than PROBE, `refuse_unvouched` after the last."""
        self.next_token_checks += 1
        self.next_token_agreements += int(served == greedy)
        if self.next_token_checks == PROBE:
            self.refuse_unvouched(sample_id)

    def refuse_unvouched(self, sample_id: str) -> None:
        """Stop the run (EndpointError, naming `sample_id`, the last sample checked) unless a server's next token
        has agreed at least once: after PROBE checks, or when the records end with samples still held."""
        if self.next_token_agreements == 0:
            raise EndpointError(f"the server's next token differs from the verifier's greedy token on its last saved "
                                f"state for all of the first {self.next_token_checks} samples (last {sample_id!r}): "
                                f"it does not capture vLLM layer ids {self.layer_ids} of this verifier (start it with "
                                "`eagle3-hf serve-vllm`)")


@dataclass(frozen=True)
class VllmOptions:
    """How vLLM runs (`extract --engine vllm`, `regenerate --engine vllm`): its compute dtype ("auto": the
    checkpoint's, checkpoint_dtype), context, engine arguments (engines/vllm/vllm_args.py), requests per call and files
    waiting at most, CPU threads, seconds per call, connector, the running server (`endpoint`, its `storage`
    directory) instead of an engine of our own, reader threads, and whether it shows its logs (--debug)."""

    dtype: str = "auto"
    max_model_len: int | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int = 8
    max_pending: int | None = None
    threads: int = 1
    timeout: float | None = None
    connector: str = "auto"
    endpoint: str | None = None
    storage: str | None = None
    readers: int | None = None
    debug: bool = False

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """`extract --engine vllm`'s flags: the run's knobs and the server's storage in one group, then vLLM's
        engine group (engines/vllm/vllm_args.py)."""
        from ...engines.vllm.vllm_args import add_engine_arguments, add_run_arguments

        group = parser.add_argument_group("--engine vllm (the serving engine computes the states; `make vllm`)")
        add_run_arguments(group, "prompts", "; with --endpoint, seconds per request and its file (default 600)")
        group.add_argument("--vllm-storage", default=None, metavar="DIR",
                           help="with --endpoint (a vLLM OpenAI server started with the extraction config by "
                                "`eagle3-hf serve-vllm`, sent --vllm-batch-size requests at a time): the server's "
                                "storage directory, which this machine must see, the only place whose files are "
                                "read and deleted (default: the one `eagle3-hf serve-vllm` names)")
        add_engine_arguments(parser)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> VllmOptions:
        """From a command's arguments (engines/vllm/vllm_args.py's run and engine arguments; --endpoint where it has
        it), checked: vLLM places the verifier itself, one engine per process, the run's knobs in range, and a context
        the engine can prefill in one step (with an engine of our own; a server's is checked once the longest sample
        is known)."""
        from ...engines.vllm.vllm_args import check_batched_tokens, check_offline, check_run_arguments, engine_from_args

        if any(getattr(args, name, None) for name in ("device_map", "max_memory", "offload_folder", "device")):
            raise UsageError("--engine vllm places the verifier itself: drop --device-map/--max-memory/"
                             "--offload-folder/--device (use --tensor-parallel-size)")
        engine = engine_from_args(args)
        check_offline(engine)
        check_run_arguments(args)
        endpoint = getattr(args, "endpoint", None)
        if args.max_model_len and not endpoint:
            check_batched_tokens(engine, args.max_model_len)
        return cls(dtype=args.torch_dtype, max_model_len=args.max_model_len, engine=engine,
                   batch_size=args.vllm_batch_size, max_pending=args.vllm_max_pending, threads=args.threads,
                   timeout=args.vllm_timeout, endpoint=endpoint, storage=getattr(args, "vllm_storage", None),
                   readers=args.vllm_readers, debug=debug_requested())

    def close(self) -> None:
        """Nothing to release: the engine's processes belong to the route."""
