"""What a feature directory records (store.py writes it, reader.py reads it): the format's name and version, the
storage dtypes, the header every shard journal starts with, and the typed shard, sample, journal and manifest
records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict, cast

import torch

FORMAT, VERSION = "eagle3_hf.features", 1
DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "float8": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
                  "fp32": "float32", "f32": "float32"}
# Header fields that must match to append to a directory (the verifier dict is compared whole).
# "source" names the capture path (transformers here, or an engine's tool via routes/engine_files.py): features from
# different paths differ numerically and must not be mixed silently either.
HEADER_KEYS = ("format", "version", "source", "verifier", "tokenizer_fingerprint", "aux_layer_indices", "dtype")
# Per-sample tensors in checksum order; scales only exist for fp8.
SAMPLE_KEYS = ("input_ids", "loss_mask", "verifier_greedy", "aux_hidden_states", "aux_hidden_states_scale",
               "last_hidden_state", "last_hidden_state_scale")
VERIFIER_HASH_KEYS = ("config_sha256", "head_sha256")  # verifier/identity.py: in the verifier record when known


class _HeaderFields(TypedDict):
    format: str
    version: int
    source: str
    verifier: dict[str, Any]  # source.VerifierIdentity.as_dict()
    tokenizer_fingerprint: str
    aux_layer_indices: list[int]
    dtype: str


class FeatureHeader(_HeaderFields, total=False):
    """A journal's header line and the head of manifest.json (HEADER_KEYS, then how the route mapped the states and
    the tokenizer class that made the ids, with its --trust-remote-code: data/fingerprint.py)."""

    provenance: dict[str, Any]
    tokenizer_class: str
    trust_remote_code: bool
    chat_template_kwargs: dict[str, Any]  # the thinking mode the text was rendered in (data/thinking_mode.py)


class _ShardFields(TypedDict):
    file: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int


class ShardRecord(_ShardFields, total=False):
    """One shard in a journal line and in manifest.json's "shards"."""

    written: dict[str, int]  # the file's mtime_ns, ctime_ns and inode once written (store.file_stamp; verify.py)


class SampleRecord(TypedDict):
    """One sample in a journal line and in manifest.json's "samples": where its tokens lie in its shard."""

    id: str
    shard: str
    offset: int
    length: int
    sha256: str


class JournalRecord(TypedDict):
    """A journal line after the header: a shard (None when the line only records skipped samples) and its samples."""

    shard: ShardRecord | None
    samples: list[SampleRecord]
    skipped: dict[str, list[str]]  # reason -> sample ids


class _ManifestFields(FeatureHeader):
    shards: list[ShardRecord]
    samples: list[SampleRecord]
    skipped: dict[str, int]  # reason -> count
    skipped_ids: dict[str, list[str]]  # reason -> sample ids


class Manifest(_ManifestFields, total=False):
    """manifest.json: the header, then every rank's journal merged."""

    missing_samples: int  # samples no rank has written or skipped (a merge that stopped waiting)
    unfinished: bool  # in memory only: merged from the journals, no manifest.json
    node_part: NodePart  # one node's ranks only (`extract --per-node-output` on a directory local to each node)


class NodePart(TypedDict):
    """manifest.json of one node's part of a multi-node extraction: which part, and of which dataset."""

    node: int  # 0 .. nodes - 1
    nodes: int
    host: str
    dataset_samples: int  # the prepared dataset's samples, over every node
    dataset_ids_sha256: str  # sha256 of its sample ids, one per line: the parts of one dataset have the same


def canonical_dtype(name: str) -> str:
    name = _DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if name not in DTYPES:
        raise ValueError(f"unknown feature dtype {name!r}: choose bf16, fp8 (float8_e4m3fn) or float32")
    return name


def make_header(verifier: Mapping[str, Any], tokenizer_fingerprint: str, aux_layer_indices: Sequence[int],
                dtype: str, source: str = "transformers", **extra: Any) -> FeatureHeader:
    header: dict[str, Any] = {"format": FORMAT, "version": VERSION, "source": source, "verifier": dict(verifier),
              "tokenizer_fingerprint": tokenizer_fingerprint,
              "aux_layer_indices": [int(i) for i in aux_layer_indices], "dtype": canonical_dtype(dtype)}
    header.update(extra)
    return cast(FeatureHeader, header)  # the fields above, then `extra` (provenance)
