"""One interface for every way to get the verifier's hidden states.

A route (transformers hooks, transformers while generating, vLLM offline, vLLM's OpenAI server, our feature server,
files written by speculators or SpecForge) is a `FeatureSource`: it names what it captures (`SourceIdentity`: the
verifier, its widths, the aux layer indices, the tokenizer it was rendered with, the storage dtype, the capture
path) and turns prepared samples into `SampleFeatures`. Everything downstream (the store's shards, the reader,
training's identity check) sees only these two records, so the trainer never knows which route ran and a new
engine is one more module in `routes/`, one class added to the table (`table.py`). The routes, their spellings
and what each serves are listed in docs/development.md's route table, generated from that table.

The offline routes write through one loop (`write.write_features`); the store is `store.py`, its reader
`reader.py`, packing into training rows `packing.py`; online, the one collator (`collator.FeatureCollator`) asks
any source for a batch's samples and builds the batch offline would (`feature_cache.py` keeps them on disk).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..data.prepared_samples import PreparedSample as PreparedSample  # the sample a route reads (re-exported)
from .records import FeatureHeader, make_header


@dataclass(frozen=True)
class VerifierIdentity:
    """The verifier a feature directory was captured from: the manifest's `verifier` record. `config_sha256` and
    `head_sha256` (verifier/identity.py) tell same-shape checkpoints apart; None where they were not recorded
    (features written before they were, or a verifier without files), and then left out of the record."""

    name: str
    revision: str | None
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    config_sha256: str | None = None
    head_sha256: str | None = None

    def as_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {"name": self.name, "revision": self.revision,
                                  "num_hidden_layers": self.num_hidden_layers, "hidden_size": self.hidden_size,
                                  "vocab_size": self.vocab_size}
        record.update({k: v for k, v in self.hashes().items() if v is not None})
        return record

    def hashes(self) -> dict[str, str | None]:
        return {"config_sha256": self.config_sha256, "head_sha256": self.head_sha256}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> VerifierIdentity:
        return cls(str(record.get("name")), record.get("revision"), int(record.get("num_hidden_layers") or 0),
                   int(record.get("hidden_size") or 0), int(record.get("vocab_size") or 0),
                   record.get("config_sha256"), record.get("head_sha256"))

    @classmethod
    def of(cls, config: Any, name: str, revision: str | None = None,
           files: str | None = None) -> VerifierIdentity:
        """From a verifier's (text) config; the hashes from its files at `files` (a directory or Hub id; default
        `name`) where they can be read."""
        from ..verifier.identity import teacher_hashes

        hashes = teacher_hashes(str(files or name), revision) if (files or name) else {}
        return cls(str(name), revision, int(config.num_hidden_layers), int(config.hidden_size),
                   int(config.vocab_size), hashes.get("config_sha256"), hashes.get("head_sha256"))

    @classmethod
    def of_model(cls, model: Any, name: str | None = None, revision: str | None = None) -> VerifierIdentity:
        """Of a loaded verifier (a transformers model): named `name`, else the path it was loaded from, else its
        class; the hashes from the files it was loaded from."""
        from ..verifier.family import text_config

        loaded_from = getattr(model.config, "_name_or_path", None)  # the files its hashes are read from
        name = name or loaded_from or type(model).__name__
        return cls.of(text_config(model), str(name), revision, files=loaded_from or str(name))

    def differences(self, other: VerifierIdentity) -> list[str]:
        """What of `other` contradicts this record: the shapes, and each hash both hold ("config_sha256 ab12..
        != cd34.."). Empty when they agree on everything both record."""
        found = [f"{k} {getattr(self, k)} != {getattr(other, k)}" for k in ("num_hidden_layers", "hidden_size",
                                                                             "vocab_size")
                 if getattr(self, k) and getattr(other, k) and getattr(self, k) != getattr(other, k)]
        found += [f"{k} {a[:12]} != {b[:12]}" for k, a, b in
                  ((k, self.hashes()[k], other.hashes()[k]) for k in ("config_sha256", "head_sha256"))
                  if a and b and a != b]
        return found

    def fully_recorded(self) -> bool:
        return self.config_sha256 is not None and self.head_sha256 is not None


@dataclass(frozen=True)
class SourceIdentity:
    """What a feature source captures: written as every shard directory's header, checked when appending to one
    and when training reads it."""

    verifier: VerifierIdentity
    tokenizer_fingerprint: str
    aux_layer_indices: tuple[int, ...]
    dtype: str  # storage dtype, canonical (`records.canonical_dtype`)
    source: str = "transformers"  # the capture path: "transformers", "vllm", "vllm/speculators", ...
    provenance: Mapping[str, Any] | None = field(default=None, compare=False)  # how the route mapped the states

    def header(self) -> FeatureHeader:
        """The shard header / manifest head (`records.HEADER_KEYS`, then the provenance)."""
        extra = {} if self.provenance is None else {"provenance": dict(self.provenance)}
        return make_header(self.verifier.as_dict(), self.tokenizer_fingerprint, self.aux_layer_indices, self.dtype,
                           source=self.source, **extra)

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> SourceIdentity:
        """From a manifest or a journal header."""
        return cls(VerifierIdentity.from_dict(header.get("verifier") or {}), str(header.get("tokenizer_fingerprint")),
                   tuple(int(i) for i in header.get("aux_layer_indices") or ()), str(header.get("dtype")),
                   str(header.get("source", "transformers")), header.get("provenance"))


@dataclass
class SampleFeatures:
    """What a route makes of one sample: the three aux states concatenated, the post-norm final state and the
    verifier's full-vocabulary greedy token per position."""

    sample: PreparedSample
    aux_hidden_states: torch.Tensor  # [T, 3H]
    last_hidden_state: torch.Tensor  # [T, H], after the final norm
    verifier_greedy: torch.Tensor  # [T]
    # what a route that prepares samples in parallel (vLLM's readers) already made of them: the tensors as a shard
    # stores them (store.stored_sample, checked finite) and their sample_sha256, so the writer only queues them
    stored: dict[str, torch.Tensor] | None = None
    stored_sha256: str | None = None
    # set when the route has no features for this sample and says why (imports: "missing_file"): the writer records
    # it as skipped, counted and listed in the manifest's skipped_ids, and the tensors are empty
    skip_reason: str | None = None

    @classmethod
    def skipped(cls, sample: PreparedSample, reason: str) -> SampleFeatures:
        """A sample the route cannot answer, with the reason the manifest records."""
        empty = torch.empty(0)
        return cls(sample, empty, empty, empty, skip_reason=reason)


class FeatureSource(Protocol):
    """A route to hidden states. `check` sees the lengths of every sample of this rank before anything is written
    (a server serving another verifier: refused with nothing on disk) and returns the most tokens a sample may
    have on this route (None: any), so that a longer one is skipped and counted, alone (write.py); `states` may
    answer in any order and hold samples back, but answers each sample at most once; `report` adds the route's
    own facts (engine version, load time) to the extraction summary. A sample the route has nothing for is
    answered `SampleFeatures.skipped(sample, reason)`."""

    identity: SourceIdentity

    def check(self, lengths: Sequence[int]) -> int | None: ...

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]: ...

    def report(self) -> dict[str, Any]: ...


class RouteOptions(Protocol):
    """A route's own options: `add_arguments` adds its flags to a command that runs it (`extract`), in a group of
    their own; `from_args` reads and checks them once into this typed record, which the route gets as
    `SourceRequest.options`; `close` releases what reading them made (a temporary folder) once the route is done."""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None: ...

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouteOptions: ...

    def close(self) -> None: ...


class CapturedSource(FeatureSource, Protocol):
    """A route whose samples come in the order another tool captured them (`import-features`): `captured` yields
    them, named by the sample of our prepared dataset with the same tokens where one is given; `fmt` names the
    tool."""

    fmt: str

    def captured(self, prepared: Any = None) -> Iterator[PreparedSample]: ...
