"""What `train --features` resolves to: the packed training and validation splits, the collator that makes their
batches, and what the features are of, for every route alike.

`--features DIR` reads the shards `extract` wrote; `--features hf[:VERIFIER]` runs the verifier in this process on
the samples of `--prepared-dir`, nothing on disk; `--features http://HOST:PORT` asks a feature server (`eagle3-hf
serve-features`) for each batch's states. The prepared dataset is opened (and checked) once, first; the server
before anything else is built: unreachable, or serving
another verifier than `--verifier` (hidden size, layer count) or another tokenizer than the prepared dataset's
(fingerprint), it is refused with one line. With `--cache-features DIR` its features are kept in DIR
(features/feature_cache.py) and read from there after. Whatever the route, the features' verifier is checked
against `--verifier` the same way (`check_features_fit`): its shapes, tokenizer and the hashes of its config and
head tensors (verifier/identity.py) must agree, and `--verifier` defaults to the verifier the features name
(`resolve_features_verifier`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..constants import VOCAB_FILE
from ..data.fingerprint import check_tokenizer_class, recorded_tokenizer, tokenizer_fingerprint
from ..errors import UsageError
from ..verifier.family import text_config
from ..verifier.fit import misfits
from .arguments import DataArguments, ModelArguments

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

    from ..features.collator import FeatureCollator
    from ..features.interface import SourceIdentity
    from ..features.packing import PackedCollator, PackedDataset
    from ..features.reader import FeatureDataset
    from ..features.table import FeatureSpec
    from .nodes import NodeRows

logger = logging.getLogger("eagle3_hf.train")
DEFAULT_WORKERS = 2  # data-loader workers that keep a feature server's next batches' requests in flight


def endpoint_loader_workers(requested: int, cuda: bool | None = None) -> int:
    """Data-loader workers for `--features URL`, whose collator applies the verifier's final norm and greedy head.
    With a GPU, none: the collator runs in the main process with the head on the accelerator (a forked worker
    cannot use CUDA, and the head must not fall back to fp32 on the CPU there); its request threads still keep a
    batch's samples in flight together. Without one, `requested` or DEFAULT_WORKERS."""
    import torch

    if torch.cuda.is_available() if cuda is None else cuda:
        if requested:
            logger.warning("--dataloader_num_workers %d ignored with --features URL on a GPU: the verifier's head "
                           "runs on the GPU in the main process", requested)
        return 0
    return requested or DEFAULT_WORKERS


@dataclass
class TrainingFeatures:
    """What `--features` resolved to: the packed splits, the collator that makes their batches, and what the
    features are of (`identity`, checked against the verifier the same way for every route)."""

    train: PackedDataset | NodeRows  # NodeRows: this node's part, over several nodes (--per-node-features)
    evals: PackedDataset | NodeRows
    collator: PackedCollator | FeatureCollator
    identity: SourceIdentity  # the verifier, tokenizer, aux layers and dtype the features are (or will be) of
    source: str  # the feature or prepared directory, for the summary and the messages
    endpoint: str | None = None  # the URL of the server that computes them (a feature server, SGLang)
    online: bool = False  # computed while training, nothing on disk
    tokenizer: dict[str, Any] = field(default_factory=dict)  # the class that tokenized the data (data/fingerprint.py)
    shards: FeatureDataset | None = None  # a feature directory, its checksums not checked yet (`verify_features`)


def build_datasets(data_args: DataArguments, model_args: ModelArguments, verifier_config: PreTrainedConfig,
                   node_parts: bool = False) -> TrainingFeatures:
    """The training data of `--features`: shards read back, or features computed while training by the route the
    table opens (features/table.py) for the samples of `--prepared-dir`. `node_parts`: the directory holds
    this node's part of a multi-node extraction (train/nodes.py checked the parts)."""
    from ..features.table import FeatureSpec

    if not data_args.features:
        raise UsageError(f"pass --features: {FeatureSpec.SYNTAX}")
    spec = FeatureSpec.parse(data_args.features)
    if spec.online:
        return online_datasets(spec, data_args, model_args)
    if data_args.cache_features:
        raise UsageError("--cache-features keeps what an online route computes: pass --features http://HOST:PORT, "
                         "sglang:http://HOST:PORT or hf")
    return directory_datasets(spec.target, data_args, node_parts)


def directory_datasets(directory: str, data_args: DataArguments, node_parts: bool) -> TrainingFeatures:
    """`--features DIR`: the shards `extract` wrote, read back (the manifest, sizes and safetensors headers only: the
    checksums come after the cheap checks, `verify_features`)."""
    from ..features.interface import SourceIdentity
    from ..features.packing import PackedCollator, pack_splits
    from ..features.reader import FeatureDataset

    shards = FeatureDataset(directory, "all", verify="none", allow_partial=data_args.allow_partial_features,
                            node_part=node_parts)  # opened once: the manifest and shard headers read once
    vf = data_args.validation_fraction
    train, evals = pack_splits(shards.select("train", vf, max_tokens=data_args.max_train_tokens),
                               shards.select("validation", vf), data_args.max_seq_len, data_args.packing,
                               data_args.overlong)
    return TrainingFeatures(train, evals, PackedCollator(max_seq_len=data_args.max_seq_len),
                            SourceIdentity.from_header(shards.manifest), directory,
                            tokenizer=recorded_tokenizer(shards.manifest), shards=shards)


def online_dtype(kind: str, features_dtype: str | None) -> str:
    """The dtype an online route's batches are rounded to: `--features-dtype` (default bf16) where its row rounds
    them (`online_rounding`: another process computes them, as a shard would store them), else float32, as the
    route computed them (the contract test holds each row to it against the verifier's own forward)."""
    from ..features.table import SOURCES

    return (features_dtype or "bfloat16") if SOURCES[kind].online_rounding else "float32"


def online_datasets(spec: FeatureSpec, data_args: DataArguments, model_args: ModelArguments) -> TrainingFeatures:
    """`--features hf[:VERIFIER]`, `http://HOST:PORT` or `sglang:http://HOST:PORT`: the samples of --prepared-dir,
    packed as a feature directory's would be, their features asked of the route the table opens, batch by batch
    (FeatureCollator), kept in `--cache-features DIR` when given."""
    from ..data.prepared_samples import PreparedDataset
    from ..features.collator import FeatureCollator
    from ..features.feature_cache import FeatureCache
    from ..features.packing import pack_splits
    from ..features.table import OnlineOptions, SourceRequest, open_source

    if not data_args.prepared_dir:
        raise UsageError(f"--features {data_args.features} computes features while training: pass --prepared-dir "
                         "(the prepared dataset whose samples it reads)")
    if data_args.max_train_tokens is not None:
        raise UsageError("--max-train-tokens applies to a feature directory (--features DIR)")
    every = PreparedDataset(data_args.prepared_dir, "all")  # opened once: its meta, the samples of both splits
    fingerprint = every.meta["tokenizer_fingerprint"]
    dtype = online_dtype(spec.kind, data_args.features_dtype)
    source = open_source(SourceRequest(spec.kind, spec.target, str(model_args.verifier), model_args.verifier_revision,
                                       dtype=dtype, tokenizer_fingerprint=fingerprint,
                                       options=OnlineOptions(data_args.prepared_dir, data_args.online_timeout,
                                                             data_args.online_retries)))
    cache = None
    if data_args.cache_features:  # the route's own header: DIR is an ordinary feature directory
        cache = FeatureCache(data_args.cache_features, source.identity.header())
    collator = FeatureCollator(source, every, cache=cache, max_seq_len=data_args.max_seq_len)
    logger.info("features from %s (%s), rounded to %s%s", spec.target or model_args.verifier,
                ", ".join(f"{k} {v}" for k, v in (source.identity.provenance or {"source": spec.kind}).items()),
                collator.storage_dtype, f", kept in {cache.dir}" if cache else "")
    vf = data_args.validation_fraction
    train, evals = pack_splits(every.select("train", vf), every.select("validation", vf), data_args.max_seq_len,
                               data_args.packing, data_args.overlong)
    return TrainingFeatures(train, evals, collator, source.identity, data_args.prepared_dir,
                            endpoint=spec.target if spec.remote else None, online=True,
                            tokenizer=recorded_tokenizer(every.meta))


def untrained_tails(stats: dict[str, float], max_seq_len: int, longest: int, source: str) -> str | None:
    """What --overlong truncate leaves untrained (one line), or None: samples longer than --max-seq-len were
    prepared and extracted whole, but only their first max_seq_len tokens are trained on. `stats`: the packed
    training split's (features/packing.py)."""
    cut, tokens = int(stats.get("truncated", 0)), int(stats.get("truncated_tokens", 0))
    if not cut:
        return None
    share = tokens / max(tokens + int(stats.get("tokens", 0)), 1)
    return (f"{source}: {cut} training samples are longer than --max-seq-len {max_seq_len} (the longest has "
            f"{longest} tokens): their last {tokens} tokens ({share:.1%} of the split) were extracted but are not "
            f"trained on (--overlong truncate). Train at the extracted length (--max-seq-len {longest}), or "
            f"--overlong split; or prepare with --max-seq-len {max_seq_len} so they are never extracted")


def warn_untrained_tails(features: TrainingFeatures, data_args: DataArguments) -> None:
    """Log `untrained_tails` for the training split, whatever the route (before it is spread over nodes)."""
    from ..features.packing import PackedDataset  # at run time: the module's import is for annotations only

    if not isinstance(features.train, PackedDataset):
        return
    longest = max(features.train.dataset.lengths, default=0)
    message = untrained_tails(features.train.stats, data_args.max_seq_len, longest, features.source)
    if message:
        logger.warning(message)


def verify_features(features: TrainingFeatures, data_args: DataArguments) -> int:
    """A feature directory's shard checksums (`--verify-features`, `--verify-threads`; features/verify.py), the only
    full read of the directory; returns how many shards were hashed (none for online routes)."""
    if features.shards is None:
        return 0
    start = time.perf_counter()
    hashed = features.shards.verify_checksums(data_args.verify_features, data_args.verify_threads or None)
    if hashed:
        logger.info("%s: hashed %d of %d shards in %.1f s (--verify-features %s)", features.source, hashed,
                    len(features.shards.manifest["shards"]), time.perf_counter() - start, data_args.verify_features)
    return hashed


def resolve_features_verifier(data_args: DataArguments, model_args: ModelArguments) -> str:
    """`--verifier` unset: the verifier the features name (a directory's manifest, `hf:NAME`, a feature server's
    identity), with its revision; the embedded default only when they name none. Said on the log."""
    from ..verifier.loading import DEFAULT_VERIFIER

    if model_args.verifier:
        return model_args.verifier
    named, revision = features_verifier(data_args.features)
    if named is None:
        model_args.verifier = DEFAULT_VERIFIER
        return DEFAULT_VERIFIER
    if named.startswith(("/", ".", "~")) and not Path(named).expanduser().exists():
        raise UsageError(f"--features {data_args.features} names the verifier {named}, which is not on this "
                         "machine: pass --verifier (the same checkpoint here)")
    model_args.verifier = named
    if model_args.verifier_revision is None:
        model_args.verifier_revision = revision
    logger.info("--verifier %s: the verifier --features %s names", named, data_args.features)
    return named


def features_verifier(features: str | None) -> tuple[str | None, str | None]:
    """(name, revision) of the verifier `--features` names (the table's `names_verifier` of its route: a directory's
    manifest, `hf:NAME`, a feature server's identity); (None, None) where it names none (`hf`, or a directory that
    cannot be read: building the datasets then says why)."""
    from ..features.table import FeatureSpec

    if not features:
        return None, None
    return FeatureSpec.parse(features).named_verifier()


def check_features_fit(features: TrainingFeatures, verifier_config: PreTrainedConfig,
                       model_args: ModelArguments) -> None:
    """Features of another verifier are refused before anything is built, whatever the route: another hidden
    size, layer count, vocabulary or tokenizer, or (where the features record them) another config or head
    (`VerifierIdentity.differences`). Features that record no hashes are checked on what they hold, with a
    warning that the teacher could not be fully checked."""
    from ..features.interface import VerifierIdentity

    recorded = features.identity.verifier.hidden_size or None  # the width the drafter's fc will read
    found = misfits(verifier_config, target_hidden_size=recorded, what="features")
    if found:
        raise UsageError(f"{features.source}: features have hidden size {found[0].value}, the verifier "
                         f"{model_args.verifier} has {found[0].expected}")
    if features.online and not features.endpoint:
        return  # `--features hf`: the features are computed by --verifier itself
    teacher = VerifierIdentity.of(text_config(verifier_config), str(model_args.verifier),
                                  model_args.verifier_revision)
    differ = features.identity.verifier.differences(teacher)
    tokenizer = teacher_tokenizer(model_args)
    fingerprint = None
    if tokenizer is not None:
        check_tokenizer_class(features.tokenizer, tokenizer, features.endpoint or features.source)
        fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is not None and fingerprint != features.identity.tokenizer_fingerprint:
        differ.append(f"tokenizer_fingerprint {features.identity.tokenizer_fingerprint[:12]} != {fingerprint[:12]}")
    if differ:
        raise UsageError(f"{features.endpoint or features.source}: features of the verifier "
                         f"{features.identity.verifier.name}, not of --verifier "
                         f"{model_args.verifier} ({'; '.join(differ)}): train with the verifier the features were "
                         "extracted from")
    missing = [k for k, v in features.identity.verifier.hashes().items() if v is None or teacher.hashes()[k] is None]
    if missing:
        names = "" if features.identity.verifier.name == str(model_args.verifier) else \
            f"; they name {features.identity.verifier.name}, --verifier is {model_args.verifier}"
        logger.warning("%s: the teacher could not be fully checked: no %s on both sides (features from before "
                       "they were recorded, or a verifier without files here); compared layers, widths, vocabulary "
                       "and tokenizer only%s", features.source, " or ".join(missing), names)


def teacher_tokenizer(model_args: ModelArguments) -> PreTrainedTokenizerBase | None:
    """The tokenizer of --verifier (with its --trust-remote-code); None when it has no tokenizer to load here."""
    from ..verifier.loading import load_tokenizer

    try:
        return load_tokenizer(str(model_args.verifier), revision=model_args.verifier_revision)
    except (OSError, ValueError):
        return None


def load_vocabulary(data_args: DataArguments, features: TrainingFeatures,
                    verifier_config: PreTrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of `--vocab` (default: the feature or prepared directory's), refused if built for another
    tokenizer."""
    from ..data.vocab import load_vocab

    vocab_size = int(text_config(verifier_config).vocab_size)
    d2t, t2d, _ = load_vocab(default_vocab_path(data_args), features.identity.tokenizer_fingerprint, vocab_size)
    return d2t, t2d


def default_vocab_path(data_args: DataArguments) -> str:
    if data_args.vocab:
        return data_args.vocab
    from ..features.table import FeatureSpec

    directory = data_args.features if data_args.features and not FeatureSpec.parse(data_args.features).online \
        else None
    for base in (directory, data_args.prepared_dir):
        if base and (Path(base) / VOCAB_FILE).is_file():
            return str(Path(base) / VOCAB_FILE)
    raise UsageError("no vocab.safetensors found: build one with `eagle3-hf vocab` or pass --vocab")
