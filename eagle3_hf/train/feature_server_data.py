"""`--online-endpoint URL`: the training script's datasets when a feature server computes the features.

The prepared dataset and its packing plan are read as `--online` reads them; the collator
(features/feature_server.py) fetches each batch's states from the server. The server is checked before
anything is built: unreachable, or serving another verifier than `--verifier` (hidden size, layer count)
or another tokenizer than the prepared dataset's (fingerprint), it is refused with one line. With
`--cache-features DIR` the fetched features are kept in DIR (features/feature_cache.py) and read from there after.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..verifier.family import logit_softcap, text_config
from .arguments import DataArguments, ModelArguments

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from ..features.feature_server import EndpointFeatureCollator
    from ..features.packing import PackedDataset

logger = logging.getLogger("eagle3_hf.train")
DEFAULT_WORKERS = 2  # data-loader workers that keep the next batches' requests in flight


def build_endpoint_datasets(data_args: DataArguments, model_args: ModelArguments, verifier_config: PreTrainedConfig
                            ) -> tuple[PackedDataset, PackedDataset, EndpointFeatureCollator, dict]:
    """(train, eval, collator, info) as setup.build_datasets returns them, features from the server."""
    from ..data.prepared_format import read_prepared_meta
    from ..features.feature_cache import FeatureCache
    from ..features.feature_server import EndpointFeatureCollator, FeatureClient
    from ..features.packing import PackedDataset
    from ..features.store import canonical_dtype, make_header
    from ..features.transformers_online import PreparedDataset
    from ..verifier.head import load_verifier_head
    from ..verifier.loading import resolve_verifier

    url = str(data_args.online_endpoint)
    if data_args.online:
        raise SystemExit("--online runs the verifier in this process, --online-endpoint asks a server: choose one")
    if not data_args.prepared_dir:
        raise SystemExit("--online-endpoint needs --prepared-dir (the prepared dataset whose features it serves)")
    if data_args.max_train_tokens is not None:
        raise SystemExit("--max-train-tokens applies to offline features (--data-dir)")
    fingerprint = read_prepared_meta(data_args.prepared_dir)["tokenizer_fingerprint"]
    config = text_config(verifier_config)
    client = FeatureClient(url, timeout=data_args.online_timeout, retries=data_args.online_retries)
    expected = {"hidden_size": int(config.hidden_size), "num_hidden_layers": int(config.num_hidden_layers),
                "tokenizer_fingerprint": fingerprint}
    identity = client.check(expected, names={"hidden_size": f", {model_args.verifier}",
                                             "num_hidden_layers": f", {model_args.verifier}",
                                             "tokenizer_fingerprint": f", {data_args.prepared_dir}"})
    norm, head, _ = load_verifier_head(resolve_verifier(model_args.verifier), model_args.verifier_revision)
    vf = data_args.validation_fraction
    pack: dict[str, Any] = dict(max_seq_len=data_args.max_seq_len, packing=data_args.packing,
                                overlong=data_args.overlong)
    train_samples = PreparedDataset(data_args.prepared_dir, "train", vf, fingerprint)
    eval_samples = PreparedDataset(data_args.prepared_dir, "validation", vf, fingerprint)
    every = PreparedDataset(data_args.prepared_dir, "all", vf, fingerprint)  # both splits' samples, by id
    dtype = canonical_dtype(data_args.feature_dtype or "bfloat16")
    cache = None
    if data_args.cache_features:  # extract --engine vllm's header: DIR is an ordinary feature directory
        verifier = {"name": str(model_args.verifier), "revision": model_args.verifier_revision,
                "num_hidden_layers": expected["num_hidden_layers"], "hidden_size": expected["hidden_size"],
                "vocab_size": int(config.vocab_size)}
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
    info = {"aux_layer_indices": list(identity["aux_layer_indices"]), "tokenizer_fingerprint": fingerprint,
            "source_dir": data_args.prepared_dir, "verifier": {"hidden_size": identity["hidden_size"]},
            "endpoint": url}
    return PackedDataset(train_samples, **pack), PackedDataset(eval_samples, **pack), collator, info
