"""Building a DFlash drafter for a training run (`train --drafter-kind dflash`): its mask token and its config.

The mask token is fed at every masked block position and embedded with the verifier's own embedding (all three
engines do), so it must be a token the training data never contains: else a block's anchor could be the mask
itself and the drafter could not tell them apart. Default: the tokenizer's special or added token of highest id
that appears nowhere in the data (eos, bos and pad excluded); `--mask-token-id` names one, refused in one line if
the data contains it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import UsageError
from ..model.configuration_dflash import DFlashConfig
from ..model.modeling_dflash import DFlashDraftModel

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from .arguments import ModelArguments

logger = logging.getLogger("eagle3_hf.train")


def tokens_present(datasets: Iterable[Any], vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: every token id that occurs in the samples of these datasets (a feature directory read
    through its `raw` input ids alone, or any dataset whose samples carry `input_ids`)."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for dataset in datasets:
        raw = getattr(dataset, "raw", None)
        for index in range(len(dataset)):
            ids = raw(index)["input_ids"] if raw is not None else dataset[index]["input_ids"]
            ids = torch.as_tensor(ids).long().reshape(-1)
            if ids.numel():
                seen[ids.clamp(0, vocab_size - 1)] = True
    return seen


def feature_samples(features: Any) -> list[Any]:
    """The sample sources of a run's `TrainingFeatures`: its feature directory (every split), else the packed
    splits' own datasets."""
    if features.shards is not None:
        return [features.shards]
    return [d for d in (getattr(features.train, "dataset", None), getattr(features.evals, "dataset", None)) if d]


def choose_mask_token(tokenizer: Any, present: torch.Tensor, requested: int | None = None) -> int:
    """The mask token id (see the module docstring); `present` from `tokens_present`."""
    vocab = int(present.numel())
    if requested is not None:
        if not 0 <= requested < vocab:
            raise UsageError(f"--mask-token-id {requested} is outside the verifier's vocabulary of {vocab}")
        if bool(present[requested]):
            raise UsageError(f"--mask-token-id {requested} occurs in the training data: the mask token must be one "
                             "the data never contains (pass another, or leave it out to pick an unused special token)")
        return int(requested)
    reserved = {getattr(tokenizer, name, None) for name in ("eos_token_id", "bos_token_id", "pad_token_id")}
    candidates = set(getattr(tokenizer, "all_special_ids", None) or [])
    candidates |= set((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    usable = sorted(i for i in candidates if isinstance(i, int) and 0 <= i < vocab and i not in reserved
                    and not bool(present[i]))
    if not usable:
        raise UsageError("no special token of the tokenizer is absent from the training data: pass --mask-token-id "
                         "with a token id the data never contains")
    return usable[-1]


def build_dflash_drafter(model_args: ModelArguments, verifier_config: PreTrainedConfig, aux_indices: Sequence[int],
                         fingerprint: str | None, tokenizer_class: str | None, data: Iterable[Any],
                         chat_template_kwargs: dict[str, Any] | None = None) -> tuple[DFlashDraftModel, dict[str, Any]]:
    """A DFlash drafter from scratch for this verifier and data. Returns (model, info), as `build_drafter`;
    `chat_template_kwargs`: the thinking mode the data was rendered in, recorded as an EAGLE-3 drafter records it."""
    from ..verifier.family import text_config
    from ..verifier.loading import load_tokenizer

    if model_args.finetune_from:
        raise UsageError("--finetune-from is not supported with --drafter-kind dflash yet: train from scratch")
    vocab = int(text_config(verifier_config).vocab_size)
    present = tokens_present(data, vocab)
    tokenizer = load_tokenizer(model_args.verifier or verifier_config._name_or_path,
                               revision=model_args.verifier_revision) if model_args.mask_token_id is None else None
    mask = choose_mask_token(tokenizer, present, model_args.mask_token_id)
    logger.info("DFlash mask token: id %d (absent from the training data)", mask)
    config = DFlashConfig.from_verifier(
        verifier_config, mask_token_id=mask, aux_hidden_state_indices=list(aux_indices),
        num_hidden_layers=model_args.dflash_layers, block_size=model_args.block_size,
        verifier_name_or_path=model_args.verifier, verifier_revision=model_args.verifier_revision,
        tokenizer_fingerprint=fingerprint, block_loss_decay=model_args.block_loss_decay,
        verifier_tokenizer_class=tokenizer_class, verifier_chat_template_kwargs=chat_template_kwargs)
    config._attn_implementation = "sdpa"
    model = DFlashDraftModel(config)
    model.anchors_per_row = int(model_args.dflash_anchors)
    return model, {"init": "scratch", "mask_token_id": mask}
