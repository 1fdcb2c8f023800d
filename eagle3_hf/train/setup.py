"""The pieces the training script (eagle3_hf/scripts/train.py) is composed of.

The script is what a user reads top to bottom (`eagle3-hf train` and `accelerate launch examples/train.py`
both run it); this module holds what it calls:
the arguments (HfArgumentParser dataclasses; `--config FILE.yaml|json` supplies defaults that the command
line overrides), the packed datasets (offline shards, or `--online` with the verifier producing features
in-process), the vocabulary, and the drafter (from scratch, or `--finetune-from` a directory / Hub repo in
any supported layout, its mismatches reported loudly).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..constants import VOCAB_FILE
from ..model.configuration_eagle3 import Eagle3Config
from ..model.modeling_eagle3 import Eagle3DraftModel
from ..verifier.family import text_config
from ..verifier.fit import misfits
from .arguments import DataArguments, ModelArguments

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from ..features.packing import PackedCollator, PackedDataset
    from ..features.transformers_online import OnlineFeatureCollator

logger = logging.getLogger("eagle3_hf.train")

# Step-0 accuracy on the new data, before training, of the weakest finetune source that still ended above
# training from scratch at every target-side budget run (same data, seed, lr) in
# experiments/compare_finetune_vs_scratch.py. Table in docs/finetune_vs_scratch.md: sources trained on *other*
# conversations answered by their own verifier version (ours: 0.228; a previous version: 0.104; the same with its
# own 1,024-token draft vocabulary: 0.101), 40 and 160 optimizer steps, simulated τ on validation. No source
# measured there lost to scratch, so there is no measured "scratch wins below" bound; real τ on 4 MT-bench
# questions did not separate the previous-version sources from scratch.
SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH = 0.101


# ---------------------------------------------------------------- the drafter

def build_drafter(model_args: ModelArguments, verifier_config: PreTrainedConfig, d2t: torch.Tensor,
                  t2d: torch.Tensor, aux_indices: Sequence[int],
                  fingerprint: str | None) -> tuple[Eagle3DraftModel, dict]:
    """From scratch, or from `--finetune-from` with its mismatches reported loudly. Returns (model, info)."""
    info: dict = {"init": "scratch"}
    config = Eagle3Config.from_verifier(
        verifier_config, draft_vocab_size=int(d2t.numel()), aux_hidden_state_indices=list(aux_indices),
        verifier_name_or_path=model_args.verifier, verifier_revision=model_args.verifier_revision,
        tokenizer_fingerprint=fingerprint,
    )
    config._attn_implementation = model_args.attn_implementation
    if not model_args.finetune_from:
        model = Eagle3DraftModel(config)
        model.set_vocab_mapping(d2t, t2d)
        return model, info

    source = Eagle3DraftModel.from_pretrained(model_args.finetune_from,
                                              attn_implementation=model_args.attn_implementation)
    src = source.config
    info = {"init": f"finetune:{model_args.finetune_from}", "warnings": []}
    for name in ("hidden_size", "target_hidden_size", "vocab_size"):
        if getattr(src, name) != getattr(config, name):
            raise ValueError(f"--finetune-from {model_args.finetune_from}: {name} {getattr(src, name)} cannot fit "
                             f"this verifier's {getattr(config, name)}")
    if list(src.aux_hidden_state_indices or []) != list(aux_indices):
        info["warnings"].append(f"source drafter read aux layers {src.aux_hidden_state_indices}, the data has "
                                f"{list(aux_indices)}: its fc weights expect other features")
    if src.verifier_name_or_path and src.verifier_name_or_path != model_args.verifier:
        info["warnings"].append(f"source drafter was trained for verifier {src.verifier_name_or_path!r}, "
                                f"not {model_args.verifier!r}")
    if src.tokenizer_fingerprint and fingerprint and src.tokenizer_fingerprint != fingerprint:
        info["warnings"].append("source drafter was built for another tokenizer (fingerprint differs)")
    for message in info["warnings"]:
        logger.warning("FINETUNE SOURCE MISMATCH: %s", message)
    source.config.aux_hidden_state_indices = list(aux_indices)
    source.config.verifier_name_or_path = model_args.verifier
    source.config.verifier_revision = model_args.verifier_revision
    source.config.tokenizer_fingerprint = fingerprint
    if model_args.finetune_vocab == "dataset":
        info["remapped_rows"] = source.remap_lm_head(d2t, t2d)
    return source, info


def finetune_advice(source_acc_0: float) -> str:
    """What the source's step-0 accuracy on the new data, before any training, suggests (logged with
    --finetune-from). Measured, not guessed: see SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH."""
    where = "docs/finetune_vs_scratch.md; experiments/compare_finetune_vs_scratch.py measures it on your data"
    bound = SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH
    if not math.isfinite(source_acc_0):
        return f"no validation data to diagnose the source ({where})"
    if source_acc_0 >= bound:
        return (f"at or above {bound:.3f}: every source measured from there (trained on other conversations, for "
                f"this or the previous model version, with our or its own draft vocabulary) beat training from "
                f"scratch in simulated τ at 40 and 160 steps, by less for a previous version (+0.05 to +0.08 at "
                f"160 steps, no gain in real τ on 4 MT-bench questions) ({where})")
    return (f"below {bound:.3f}, the weakest source measured: nothing measured says finetuning pays; compare both "
            f"on your data ({where})")


# ---------------------------------------------------------------- data

def build_datasets(data_args: DataArguments, model_args: ModelArguments
                   ) -> tuple[PackedDataset, PackedDataset, PackedCollator | OnlineFeatureCollator, dict]:
    """(train, eval, collator, manifest-like info). Offline reads shards; online runs the verifier."""
    from ..features.packing import PackedCollator, PackedDataset
    from ..features.reader import FeatureDataset

    vf = data_args.validation_fraction
    pack: dict[str, Any] = dict(max_seq_len=data_args.max_seq_len, packing=data_args.packing,
                                overlong=data_args.overlong)
    if data_args.online:
        from ..data.prepared_format import read_prepared_meta
        from ..features.transformers_online import OnlineFeatureCollator, PreparedDataset
        from ..verifier.loading import load_verifier

        if not data_args.prepared_dir:
            raise SystemExit("--online needs --prepared-dir")
        if data_args.max_train_tokens is not None:
            raise SystemExit("--max-train-tokens applies to offline features (--data-dir)")
        fingerprint = read_prepared_meta(data_args.prepared_dir)["tokenizer_fingerprint"]
        verifier = load_verifier(model_args.verifier, revision=model_args.verifier_revision)
        collator = OnlineFeatureCollator(verifier, max_seq_len=data_args.max_seq_len)
        train = PackedDataset(PreparedDataset(data_args.prepared_dir, "train", vf, fingerprint), **pack)
        evals = PackedDataset(PreparedDataset(data_args.prepared_dir, "validation", vf, fingerprint), **pack)
        info = {"aux_layer_indices": list(collator.aux_indices), "tokenizer_fingerprint": fingerprint,
                "source_dir": data_args.prepared_dir}
        return train, evals, collator, info
    if not data_args.data_dir:
        raise SystemExit("pass --data-dir (features from `eagle3-hf extract`) or --online --prepared-dir")
    partial = data_args.allow_partial_features
    train_features = FeatureDataset(data_args.data_dir, "train", vf, max_tokens=data_args.max_train_tokens,
                                    allow_partial=partial)
    eval_features = FeatureDataset(data_args.data_dir, "validation", vf, verify="none", allow_partial=partial)
    manifest = train_features.manifest
    info = {"aux_layer_indices": list(manifest["aux_layer_indices"]),
            "tokenizer_fingerprint": manifest.get("tokenizer_fingerprint"), "source_dir": data_args.data_dir,
            "verifier": manifest.get("verifier", {})}
    train = PackedDataset(train_features, **pack)
    evals = PackedDataset(eval_features, **pack)
    return train, evals, PackedCollator(max_seq_len=data_args.max_seq_len), info


def check_features_fit(info: dict, verifier_config: PreTrainedConfig, data_args: DataArguments,
                       model_args: ModelArguments) -> None:
    """Features extracted from another verifier (another hidden size) are refused before anything is built."""
    recorded = info.get("verifier", {}).get("hidden_size") or None  # the width the drafter's fc will read
    found = misfits(verifier_config, target_hidden_size=recorded, what="features")
    if found:
        raise SystemExit(f"{data_args.data_dir}: features have hidden size {found[0].value}, the verifier "
                         f"{model_args.verifier} has {found[0].expected}")


def load_vocabulary(data_args: DataArguments, info: dict,
                    verifier_config: PreTrainedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of `--vocab` (default: the data directory's), refused if built for another tokenizer."""
    from ..data.vocab import load_vocab

    vocab_size = int(text_config(verifier_config).vocab_size)
    d2t, t2d, _ = load_vocab(default_vocab_path(data_args), info["tokenizer_fingerprint"], vocab_size)
    return d2t, t2d


def default_vocab_path(data_args: DataArguments) -> str:
    if data_args.vocab:
        return data_args.vocab
    for base in (data_args.data_dir, data_args.prepared_dir):
        if base and (Path(base) / VOCAB_FILE).is_file():
            return str(Path(base) / VOCAB_FILE)
    raise SystemExit("no vocab.safetensors found: build one with `eagle3-hf vocab` or pass --vocab")


def finish_process(code: int) -> int:
    """End a training process: a distributed rank leaves with os._exit, skipping interpreter finalization, where
    gloo threads still holding work objects can abort a finished run (SIGABRT). Everything is written and closed
    by then. A single process (tests calling `main` in-process included) just gets `code` back."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
