"""What `train --features` resolves to: the packed training and validation splits, the collator that makes their
batches, and what the features are of, for every route alike.

`--features DIR` reads the shards `extract` wrote; `--features hf[:VERIFIER]` runs the verifier in this process on
the samples of `--prepared-dir`, nothing on disk; `--features http://HOST:PORT` asks a feature server (`eagle3-hf
serve-features`) for each batch's states. The server is checked before anything is built: unreachable, or serving
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
from ..verifier.family import logit_softcap, text_config
from ..verifier.fit import misfits
from .arguments import DataArguments, ModelArguments

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

    from ..features.feature_server import EndpointFeatureCollator
    from ..features.packing import PackedCollator, PackedDataset
    from ..features.reader import FeatureDataset
    from ..features.source import VerifierIdentity
    from ..features.transformers_online import OnlineFeatureCollator
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
    features are of (checked against the verifier the same way for every route)."""

    train: PackedDataset | NodeRows  # NodeRows: this node's part, over several nodes (--per-node-features)
    evals: PackedDataset | NodeRows
    collator: PackedCollator | OnlineFeatureCollator | EndpointFeatureCollator
    aux_layer_indices: tuple[int, ...]
    tokenizer_fingerprint: str
    verifier: VerifierIdentity  # the verifier the features are (or will be) captured from
    source: str  # the feature or prepared directory, for the summary and the messages
    endpoint: str | None = None  # a feature server's URL
    online: bool = False  # computed while training, nothing on disk
    tokenizer: dict[str, Any] = field(default_factory=dict)  # the class that tokenized the data (data/fingerprint.py)
    shards: FeatureDataset | None = None  # a feature directory, its checksums not checked yet (`verify_features`)


def build_datasets(data_args: DataArguments, model_args: ModelArguments, verifier_config: PreTrainedConfig,
                   node_parts: bool = False) -> TrainingFeatures:
    """The training data of `--features`: shards read back, or features computed while training (the verifier in
    this process, or a feature server) for the samples of `--prepared-dir`. `node_parts`: the directory holds
    this node's part of a multi-node extraction (train/nodes.py checked the parts)."""
    from ..features.packing import PackedCollator, PackedDataset
    from ..features.reader import FeatureDataset
    from ..features.source import FeatureSpec, VerifierIdentity

    if not data_args.features:
        raise UsageError(f"pass --features: {FeatureSpec.SYNTAX}")
    spec = FeatureSpec.parse(data_args.features)
    if spec.online:
        if not data_args.prepared_dir:
            raise UsageError(f"--features {data_args.features} computes features while training: pass --prepared-dir "
                             "(the prepared dataset whose samples it reads)")
        if data_args.max_train_tokens is not None:
            raise UsageError("--max-train-tokens applies to a feature directory (--features DIR)")
    if data_args.cache_features and spec.kind != "server":
        raise UsageError("--cache-features keeps what a feature server sends: pass --features http://HOST:PORT")
    if spec.kind == "server":
        return build_endpoint_datasets(spec.target, data_args, model_args, verifier_config)
    vf = data_args.validation_fraction
    pack: dict[str, Any] = dict(max_seq_len=data_args.max_seq_len, packing=data_args.packing,
                                overlong=data_args.overlong)
    if spec.kind == "transformers":
        from ..data.prepared_format import read_prepared_meta
        from ..features.transformers_online import OnlineFeatureCollator, PreparedDataset
        from ..verifier.loading import load_verifier

        if spec.target and spec.target != model_args.verifier:
            raise UsageError(f"--features {data_args.features} names another verifier than --verifier "
                             f"{model_args.verifier}: the teacher and the features must come from one verifier")
        assert data_args.prepared_dir is not None  # checked above for every online spec
        fingerprint = read_prepared_meta(data_args.prepared_dir)["tokenizer_fingerprint"]
        verifier = load_verifier(str(model_args.verifier), revision=model_args.verifier_revision)
        collator = OnlineFeatureCollator(verifier, max_seq_len=data_args.max_seq_len)
        train = PackedDataset(PreparedDataset(data_args.prepared_dir, "train", vf, fingerprint), **pack)
        evals = PackedDataset(PreparedDataset(data_args.prepared_dir, "validation", vf, fingerprint), **pack)
        who = VerifierIdentity.of(text_config(verifier_config), str(model_args.verifier),
                                  model_args.verifier_revision)
        return TrainingFeatures(train, evals, collator, tuple(collator.aux_indices), fingerprint, who,
                                data_args.prepared_dir, online=True,
                                tokenizer=recorded_tokenizer(read_prepared_meta(data_args.prepared_dir)))
    partial = data_args.allow_partial_features
    # the manifest, sizes and safetensors headers only: the checksums come after the cheap checks (verify_features)
    train_features = FeatureDataset(spec.target, "train", vf, verify="none", max_tokens=data_args.max_train_tokens,
                                    allow_partial=partial, node_part=node_parts)
    eval_features = FeatureDataset(spec.target, "validation", vf, verify="none", allow_partial=partial,
                                   node_part=node_parts)
    manifest = train_features.manifest
    return TrainingFeatures(PackedDataset(train_features, **pack), PackedDataset(eval_features, **pack),
                            PackedCollator(max_seq_len=data_args.max_seq_len),
                            tuple(int(i) for i in manifest["aux_layer_indices"]),
                            str(manifest.get("tokenizer_fingerprint")),
                            VerifierIdentity.from_dict(manifest.get("verifier") or {}), spec.target,
                            tokenizer=recorded_tokenizer(manifest), shards=train_features)


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
    """(name, revision) of the verifier `--features` names; (None, None) where it names none (`hf`, or a
    directory that cannot be read: building the datasets then says why)."""
    from ..features.source import FeatureSpec

    if not features:
        return None, None
    spec = FeatureSpec.parse(features)
    if spec.kind == "transformers":
        return spec.target or None, None
    if spec.kind == "server":
        from ..features.feature_server import FeatureClient

        found = FeatureClient(spec.target, retries=0).identity()  # unreachable, a refused key: one line now
        return (str(found["verifier"]) if found.get("verifier") else None), found.get("verifier_revision")
    from ..features.store import read_manifest

    try:
        record = read_manifest(spec.target).get("verifier") or {}
    except (OSError, ValueError, KeyError):
        return None, None
    return (str(record["name"]) if record.get("name") else None), record.get("revision")


def check_features_fit(features: TrainingFeatures, verifier_config: PreTrainedConfig,
                       model_args: ModelArguments) -> None:
    """Features of another verifier are refused before anything is built, whatever the route: another hidden
    size, layer count, vocabulary or tokenizer, or (where the features record them) another config or head
    (`VerifierIdentity.differences`). Features that record no hashes are checked on what they hold, with a
    warning that the teacher could not be fully checked."""
    from ..features.source import VerifierIdentity

    recorded = features.verifier.hidden_size or None  # the width the drafter's fc will read
    found = misfits(verifier_config, target_hidden_size=recorded, what="features")
    if found:
        raise UsageError(f"{features.source}: features have hidden size {found[0].value}, the verifier "
                         f"{model_args.verifier} has {found[0].expected}")
    if features.online and not features.endpoint:
        return  # `--features hf`: the features are computed by --verifier itself
    teacher = VerifierIdentity.of(text_config(verifier_config), str(model_args.verifier),
                                  model_args.verifier_revision)
    differ = features.verifier.differences(teacher)
    tokenizer = teacher_tokenizer(model_args)
    fingerprint = None
    if tokenizer is not None:
        check_tokenizer_class(features.tokenizer, tokenizer, features.endpoint or features.source)
        fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is not None and fingerprint != features.tokenizer_fingerprint:
        differ.append(f"tokenizer_fingerprint {features.tokenizer_fingerprint[:12]} != {fingerprint[:12]}")
    if differ:
        raise UsageError(f"{features.endpoint or features.source}: features of the verifier {features.verifier.name}, "
                         f"not of --verifier "
                         f"{model_args.verifier} ({'; '.join(differ)}): train with the verifier the features were "
                         "extracted from")
    missing = [k for k, v in features.verifier.hashes().items() if v is None or teacher.hashes()[k] is None]
    if missing:
        names = "" if features.verifier.name == str(model_args.verifier) else \
            f"; they name {features.verifier.name}, --verifier is {model_args.verifier}"
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
    d2t, t2d, _ = load_vocab(default_vocab_path(data_args), features.tokenizer_fingerprint, vocab_size)
    return d2t, t2d


def default_vocab_path(data_args: DataArguments) -> str:
    if data_args.vocab:
        return data_args.vocab
    from ..features.source import FeatureSpec

    directory = data_args.features if data_args.features and not FeatureSpec.parse(data_args.features).online \
        else None
    for base in (directory, data_args.prepared_dir):
        if base and (Path(base) / VOCAB_FILE).is_file():
            return str(Path(base) / VOCAB_FILE)
    raise UsageError("no vocab.safetensors found: build one with `eagle3-hf vocab` or pass --vocab")


def build_endpoint_datasets(url: str, data_args: DataArguments, model_args: ModelArguments,
                            verifier_config: PreTrainedConfig) -> TrainingFeatures:
    """`--features http://HOST:PORT`: setup.build_datasets' record, features from the server."""
    from ..data.prepared_format import read_prepared_meta
    from ..features.feature_cache import FeatureCache
    from ..features.feature_server import EndpointFeatureCollator, FeatureClient
    from ..features.packing import PackedDataset
    from ..features.records import canonical_dtype, make_header
    from ..features.source import VerifierIdentity
    from ..features.transformers_online import PreparedDataset
    from ..verifier.head import load_verifier_head
    from ..verifier.loading import resolve_verifier

    assert data_args.prepared_dir is not None  # build_datasets checks it for every online --features
    fingerprint = read_prepared_meta(data_args.prepared_dir)["tokenizer_fingerprint"]
    config = text_config(verifier_config)
    client = FeatureClient(url, timeout=data_args.online_timeout, retries=data_args.online_retries)
    expected = {"hidden_size": int(config.hidden_size), "num_hidden_layers": int(config.num_hidden_layers),
                "tokenizer_fingerprint": fingerprint}
    identity = client.check(expected, names={"hidden_size": f", {model_args.verifier}",
                                             "num_hidden_layers": f", {model_args.verifier}",
                                             "tokenizer_fingerprint": f", {data_args.prepared_dir}"})
    norm, head, _ = load_verifier_head(resolve_verifier(str(model_args.verifier)), model_args.verifier_revision)
    vf = data_args.validation_fraction
    pack: dict[str, Any] = dict(max_seq_len=data_args.max_seq_len, packing=data_args.packing,
                                overlong=data_args.overlong)
    train_samples = PreparedDataset(data_args.prepared_dir, "train", vf, fingerprint)
    eval_samples = PreparedDataset(data_args.prepared_dir, "validation", vf, fingerprint)
    every = PreparedDataset(data_args.prepared_dir, "all", vf, fingerprint)  # both splits' samples, by id
    dtype = canonical_dtype(data_args.features_dtype or "bfloat16")
    cache = None
    if data_args.cache_features:  # extract --engine vllm's header: DIR is an ordinary feature directory
        verifier = {"name": str(model_args.verifier), "revision": model_args.verifier_revision,
                    "num_hidden_layers": expected["num_hidden_layers"], "hidden_size": expected["hidden_size"],
                    "vocab_size": int(config.vocab_size), **served_hashes(identity)}
        provenance = {"engine": "vllm", "feature_server": url, "vllm_version": identity.get("vllm_version"),
                      "vllm_layer_ids": list(identity["layer_ids"])}
        cache = FeatureCache(data_args.cache_features, make_header(verifier, fingerprint, identity["aux_layer_indices"],
                                                                   dtype, source="vllm", provenance=provenance))
    collator = EndpointFeatureCollator(client, every, norm, head, logit_softcap(verifier_config),
                                       identity["aux_layer_indices"], identity["layer_ids"], expected["hidden_size"],
                                       max_seq_len=data_args.max_seq_len, storage_dtype=dtype, cache=cache)
    logger.info("features from %s (verifier %s, vLLM %s, ids %s), rounded to %s%s", url, identity.get("verifier"),
                identity.get("vllm_version"), identity["layer_ids"], collator.storage_dtype,
                f", kept in {cache.dir}" if cache else "")
    served = VerifierIdentity(str(identity.get("verifier") or url), identity.get("verifier_revision"),
                              int(identity["num_hidden_layers"]), int(identity["hidden_size"]),
                              int(identity.get("vocab_size") or config.vocab_size), **served_hashes(identity))
    return TrainingFeatures(PackedDataset(train_samples, **pack), PackedDataset(eval_samples, **pack), collator,
                            tuple(int(i) for i in identity["aux_layer_indices"]), fingerprint, served,
                            data_args.prepared_dir, endpoint=url, online=True,
                            tokenizer=recorded_tokenizer(read_prepared_meta(data_args.prepared_dir)))


def served_hashes(identity: dict[str, Any]) -> dict[str, str]:
    """The config and head hashes a feature server reports (`verifier_identity`), those it has."""
    found = identity.get("verifier_identity") or {}
    return {k: str(found[k]) for k in ("config_sha256", "head_sha256") if isinstance(found, dict) and found.get(k)}
