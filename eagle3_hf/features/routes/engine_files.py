"""The imported routes: hidden states captured by a serving engine's tools, read into our shards
(`eagle3-hf import-features`, features/commands/import_features.py).

At scale the verifier is best run by the engine that will serve it. Two public tools write such files; what
they store was checked in their source (speculators c05b95b, vLLM's extract_hidden_states path, SpecForge
a6b6b02, SGLang's set_eagle3_layers_to_capture):

- speculators (vLLM): a prepared Arrow dataset (input_ids, loss_mask, seq_len; `datasets.save_to_disk`) and
  `hidden_states/hs_{row}.safetensors` = {token_ids [T], hidden_states [T, 4, H]}. vLLM's layer id k is the
  residual stream entering layer k = our output_hidden_states index k; the 4th slot is id N, captured
  *before* the final norm (speculators applies `verifier_norm` itself when training). We apply the
  verifier's final norm and compute the greedy token with its lm_head.
- SpecForge (SGLang): `rows_{g}-{g+2000}/data_{i}.ckpt[.gz]`, a torch-pickled dict {input_ids [T], loss_mask
  [T], aux_hidden_state [1, T, 3H], hidden_state [1, T, H]}. SGLang's layer id k names the *output* of layer
  k, i.e. our index k+1; hidden_state is what SGLang hands its logits processor, i.e. *after* the final
  norm (SpecForge's target head is a bare lm_head). Loaded only with torch.load(weights_only=True).

Neither format records its layer ids: pass them (`--aux-layers` in our indices, or `--engine-layer-ids` as
the engine was given them). The manifest records where the features came from and what we applied.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...errors import UsageError
from ...verifier.capture import greedy_tokens
from ...verifier.family import check_aux_indices, default_aux_indices, logit_softcap
from ...verifier.head import load_verifier_head
from ..interface import PreparedSample, SampleFeatures, SourceIdentity, VerifierIdentity
from ..records import canonical_dtype
from ..table import SourceRequest

if TYPE_CHECKING:
    import datasets
    from transformers import PreTrainedModel

FORMATS = {"speculators": "vllm/speculators", "specforge": "sglang/specforge"}


# ---------------------------------------------------------------- readers

def _token_key(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int32).contiguous().numpy().tobytes()).hexdigest()


def _ids_from_prepared(prepared: datasets.Dataset | str | Path) -> dict[str, list[str]]:
    """token hash -> our sample ids, so imported samples keep the ids of our prepared dataset."""
    from ...data.prepared_format import open_prepared

    ds = open_prepared(prepared)
    rows = ds.with_format("torch", columns=["input_ids"])
    out: dict[str, list[str]] = {}
    for i, sid in enumerate(ds["id"]):
        out.setdefault(_token_key(rows[i]["input_ids"]), []).append(sid)
    return out


def read_speculators(src: str | Path, hidden_states_dir: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """Samples of a speculators offline dataset; the last state is pre-norm (`needs_norm`)."""
    from datasets import load_from_disk
    from safetensors import safe_open

    src = Path(src)
    hs_dir = Path(hidden_states_dir) if hidden_states_dir else src / "hidden_states"
    try:
        table = load_from_disk(str(src))
    except FileNotFoundError:
        raise FileNotFoundError(f"{src}: not a speculators prepared dataset (`datasets.save_to_disk` output)") from None
    absent = [c for c in ("input_ids", "loss_mask") if c not in (table.column_names or [])]
    if absent:
        raise ValueError(f"{src}: the speculators dataset has no {' or '.join(repr(c) for c in absent)} column "
                         f"(found {sorted(table.column_names or [])})")
    rows = table.with_format("torch", columns=["input_ids", "loss_mask"])
    for i in range(len(rows)):
        path = hs_dir / f"hs_{i}.safetensors"
        row = rows[i]
        base = {"index": i, "file": str(path), "input_ids": row["input_ids"].long(), "loss_mask": row["loss_mask"]}
        if not path.is_file():
            yield {**base, "missing": True}
            continue

        def load(path: Path = path) -> dict[str, Any]:
            try:
                with safe_open(path, framework="pt") as st:
                    keys = set(st.keys())
                    if not {"hidden_states", "token_ids"} <= keys:
                        raise ValueError(f"{path}: no tensor {_absent(keys, ('hidden_states', 'token_ids'))} "
                                         f"(found {sorted(keys)})")
                    hs, tok = st.get_tensor("hidden_states"), st.get_tensor("token_ids")  # [T, K, H], [T]
            except ValueError:
                raise
            except Exception as exc:  # noqa: BLE001 - safetensors' own error type: a truncated or foreign file
                raise ValueError(f"{path}: not a readable safetensors file ({_first_line(exc)})") from None
            if tok.dim() != 1:
                raise ValueError(f"{path}: token_ids has shape {tuple(tok.shape)}, expected [T]")
            if hs.dim() != 3 or hs.shape[1] != 4:
                raise ValueError(f"{path}: hidden_states has shape {tuple(hs.shape)}, expected [T, 4, H] (3 aux "
                                 f"layers + the last layer; launch vLLM with --include-last-layer)")
            return {"token_ids": tok.long(), "aux": hs[:, :3].reshape(hs.shape[0], -1), "last": hs[:, 3],
                    "needs_norm": True}

        yield {**base, "load": load}


def _first_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _absent(have: Any, keys: Sequence[str]) -> str:
    return " or ".join(repr(k) for k in keys if k not in have)


def _torch_load_safe(path: Path) -> object:  # what the file holds: a dict of tensors, callers check
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:  # a GzipFile reads like any binary file
            return torch.load(cast(IO[bytes], f), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - name the file, keep the reason
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"{path}: cannot be loaded with torch.load(weights_only=True) ({e.__class__.__name__}: "
                         f"{reason}); refusing to unpickle arbitrary objects") from None


def read_specforge(src: str | Path) -> Iterator[dict[str, Any]]:
    """Samples of a SpecForge offline directory (rows_*/data_{i}.ckpt[.gz]); the last state is post-norm."""
    files = []
    for path in Path(src).rglob("data_*.ckpt*"):
        m = re.fullmatch(r"data_(\d+)\.ckpt(\.gz)?", path.name)
        if m:
            files.append((int(m.group(1)), path))
    if not files:
        raise FileNotFoundError(f"{src}: no SpecForge files (rows_*/data_<i>.ckpt or .ckpt.gz)")
    for i, path in sorted(files):
        def load(path: Path = path) -> dict[str, Any]:
            d = _torch_load_safe(path)
            keys = ("input_ids", "loss_mask", "aux_hidden_state", "hidden_state")
            if not isinstance(d, dict):
                raise ValueError(f"{path}: holds a {type(d).__name__}, expected a dict of tensors {list(keys)}")
            if any(k not in d for k in keys):
                raise ValueError(f"{path}: no key {_absent(d, keys)} (has {sorted(map(str, d))})")
            for k in keys:
                if not isinstance(d[k], torch.Tensor) or d[k].dim() == 0:
                    raise ValueError(f"{path}: key {k!r} holds {type(d[k]).__name__} "
                                     f"{tuple(getattr(d[k], 'shape', ()))}, expected a tensor")
            aux, last = d["aux_hidden_state"], d["hidden_state"]
            return {"token_ids": d["input_ids"].reshape(-1).long(), "loss_mask": d["loss_mask"].reshape(-1),
                    "aux": aux.reshape(-1, aux.shape[-1]), "last": last.reshape(-1, last.shape[-1]),
                    "needs_norm": False}

        yield {"index": i, "file": str(path), "load": load}


# ---------------------------------------------------------------- the source

# SGLang's layer id k names the output of layer k, our output_hidden_states index k + 1; vLLM's ids are ours
ENGINE_ID_SHIFT = {"speculators": 0, "specforge": 1}


@dataclass(frozen=True)
class ImportOptions:
    """What only an import needs: speculators' hidden-states directory, when not SOURCE/hidden_states, and the
    captured layers as the engine was given them (`--engine-layer-ids`; turned into ours by the format's rule)."""

    hidden_states_dir: str | Path | None = None
    engine_layer_ids: tuple[int, ...] | None = None

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("the capture's files")
        group.add_argument("--hidden-states", default=None,
                           help="speculators: the hs_*.safetensors directory (default SOURCE/hidden_states)")
        group.add_argument("--engine-layer-ids", default=None,
                           help="captured layers as given to the engine, instead of --aux-layers (vLLM: the same "
                                "as ours; SGLang/SpecForge: ours - 1)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ImportOptions:
        if args.engine_layer_ids and getattr(args, "aux_layers", None):
            raise UsageError("give --aux-layers or --engine-layer-ids, not both")
        ids = tuple(int(x) for x in args.engine_layer_ids.split(",")) if args.engine_layer_ids else None
        return cls(args.hidden_states, ids)

    def close(self) -> None:
        """Nothing to release."""


class ImportedFeatures:
    """A speculators or SpecForge capture as a `FeatureSource`: each sample's file read when the sample is asked
    for (found by its tokens, or by the id `captured` gave it), the verifier's final norm applied where the engine
    stored the last state before it, the greedy token from the verifier's lm_head. A sample whose file the
    capture lacks (a failed request) is answered skipped, "missing_file"."""

    def __init__(self, fmt: str, src: str | Path, verifier: PreTrainedModel | str | Path, tokenizer_fingerprint: str,
                 aux_indices: Sequence[int] | None = None, dtype: str = "bfloat16",
                 verifier_revision: str | None = None, options: ImportOptions | None = None):
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}: choose from {sorted(FORMATS)}")
        self.fmt, self.src, self.options = fmt, Path(src), options or ImportOptions()
        self.norm, self.head, config = load_verifier_head(verifier, verifier_revision)
        n_layers, self.hidden = int(config.num_hidden_layers), int(config.hidden_size)
        indices = check_aux_indices(aux_indices or default_aux_indices(n_layers), n_layers)
        name = str(verifier) if not isinstance(verifier, nn.Module) else \
            getattr(verifier.config, "_name_or_path", type(verifier).__name__)
        who = VerifierIdentity.of(config, str(name), verifier_revision,
                                  files=None if isinstance(verifier, nn.Module) else str(verifier))
        provenance = {"format": fmt, "last_hidden_state": "final norm applied at import (stored pre-norm)"
                      if fmt == "speculators" else "stored post-norm by the engine",
                      "verifier_greedy": "argmax of the verifier's lm_head, computed at import"}
        self.identity = SourceIdentity(who, tokenizer_fingerprint, tuple(indices), canonical_dtype(dtype),
                                       FORMATS[fmt], provenance)
        self.softcap = logit_softcap(config)
        self._current: tuple[str, dict[str, Any], dict[str, Any] | None] | None = None  # captured()'s last item
        self._by_tokens: dict[str, list[dict[str, Any]]] | None = None
        self._given: dict[str, dict[str, Any]] = {}  # sample id -> its captured item, found by tokens

    def _read(self) -> Iterator[dict[str, Any]]:
        if self.fmt == "speculators":
            return read_speculators(self.src, self.options.hidden_states_dir)
        return read_specforge(self.src)

    def captured(self, prepared: datasets.Dataset | str | Path | None = None) -> Iterator[PreparedSample]:
        """The capture's samples in its order, named by the sample of `prepared` with the same tokens (each
        sample once), or `{format}-{row}` without it. SpecForge's tokens live in its files: each is read here once
        and kept for `states`."""
        id_map = _ids_from_prepared(prepared) if prepared is not None else None
        for item in self._read():
            tokens, mask = item.get("input_ids"), item.get("loss_mask")
            loaded = None
            if tokens is None:  # SpecForge: the tokens live in the file
                loaded = item["load"]()
                tokens, mask = loaded["token_ids"], loaded["loss_mask"]
            if id_map is not None:
                candidates = id_map.get(_token_key(tokens), [])
                if not candidates:
                    raise ValueError(f"{item['file']}: its tokens match no sample of the prepared dataset {prepared}")
                sample_id = candidates.pop(0)
            else:
                sample_id = f"{self.fmt}-{item['index']}"
            self._current = (sample_id, item, loaded)
            yield PreparedSample(sample_id, tokens, cast(torch.Tensor, mask))

    def _find(self, sample: PreparedSample) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The capture's item (and its file, when already read) for `sample`."""
        if self._current is not None and self._current[0] == sample.sample_id:
            _, item, loaded = self._current
            self._current = None
            return item, loaded
        if self._by_tokens is None:  # by tokens: SpecForge's files are read once here for theirs
            self._by_tokens = {}
            for item in self._read():
                tokens = item["input_ids"] if "input_ids" in item else item["load"]()["token_ids"]
                self._by_tokens.setdefault(_token_key(tokens), []).append(item)
        if sample.sample_id in self._given:  # asked again (a sample whose pieces fall in two training batches)
            return self._given[sample.sample_id], None
        found = self._by_tokens.get(_token_key(sample.input_ids))
        if not found:
            raise ValueError(f"{self.src}: no captured sample has the tokens of sample {sample.sample_id!r}")
        self._given[sample.sample_id] = found.pop(0)  # samples with the same tokens get one captured item each
        return self._given[sample.sample_id], None

    def check(self, lengths: Sequence[int]) -> int | None:
        return None  # any length: the engine already ran

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        for sample in samples:
            item, loaded = self._find(sample)
            if item.get("missing"):
                yield SampleFeatures.skipped(sample, "missing_file")
                continue
            loaded = loaded or item["load"]()
            if "input_ids" in item and not torch.equal(loaded["token_ids"], item["input_ids"]):
                raise ValueError(f"{item['file']}: token_ids differ from row {item['index']} of the dataset")
            aux, last = loaded["aux"], loaded["last"]
            t = sample.input_ids.shape[0]
            if aux.shape != (t, 3 * self.hidden) or last.shape != (t, self.hidden):
                raise ValueError(f"{item['file']}: aux {tuple(aux.shape)} / last {tuple(last.shape)} do not match "
                                 f"{t} tokens x hidden {self.hidden} of the verifier (3 aux layers expected)")
            with torch.no_grad():
                last = last.float()
                if loaded["needs_norm"]:
                    last = self.norm(last)  # [T, H] now post-norm, like ours
                greedy = greedy_tokens(self.head, last, self.softcap)
            yield SampleFeatures(sample, aux, last, greedy)

    def report(self) -> dict[str, Any]:
        return {"format": self.fmt}


def open_source(request: SourceRequest) -> ImportedFeatures:
    """The table's opener (table.py): the capture at `request.target` written by `request.kind` (speculators,
    specforge) from `request.verifier`; `request.options` an `ImportOptions` (None: its defaults). The tokenizer
    fingerprint is the verifier's tokenizer's unless the request names one."""
    fingerprint = request.tokenizer_fingerprint
    if not fingerprint:
        from ...data.fingerprint import tokenizer_fingerprint
        from ...verifier.loading import load_tokenizer

        fingerprint = tokenizer_fingerprint(load_tokenizer(request.verifier, revision=request.revision))
    options = request.options if isinstance(request.options, ImportOptions) else ImportOptions()
    aux = request.aux_indices
    if options.engine_layer_ids is not None:
        aux = tuple(i + ENGINE_ID_SHIFT[request.kind] for i in options.engine_layer_ids)
    return ImportedFeatures(request.kind, request.target, request.verifier, fingerprint, aux, request.dtype,
                            request.revision, options)
