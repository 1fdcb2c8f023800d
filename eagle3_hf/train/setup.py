"""The pieces the training script (eagle3_hf/scripts/train.py) is composed of.

The script is what a user reads top to bottom (`eagle3-hf train` and `accelerate launch examples/train.py`
both run it); this module holds what it calls:
the arguments (HfArgumentParser dataclasses; `--config FILE.yaml|json` supplies defaults that the command
line overrides), the packed datasets of `--features` (a directory of shards, the verifier in this process, or a
feature server), the vocabulary, and the drafter (from scratch, or `--finetune-from` a directory / Hub repo in
any supported layout, its mismatches reported loudly).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..model.configuration_eagle3 import Eagle3Config
from ..model.modeling_eagle3 import Eagle3DraftModel
from .arguments import ModelArguments

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


logger = logging.getLogger("eagle3_hf.train")

# Step-0 accuracy on the new data, before training, of the weakest finetune source that still ended above
# training from scratch at every target-side budget run (same data, seed, lr) in
# experiments/compare_finetune_vs_scratch.py. Table in docs/results/finetune_vs_scratch.md: sources trained on *other*
# conversations answered by their own verifier version (ours: 0.228; a previous version: 0.104; the same with its
# own 1,024-token draft vocabulary: 0.101), 40 and 160 optimizer steps, simulated τ on validation. No source
# measured there lost to scratch, so there is no measured "scratch wins below" bound; real τ on 4 MT-bench
# questions did not separate the previous-version sources from scratch.
SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH = 0.101


# ---------------------------------------------------------------- the drafter

def build_drafter(model_args: ModelArguments, verifier_config: PreTrainedConfig, d2t: torch.Tensor,
                  t2d: torch.Tensor, aux_indices: Sequence[int], fingerprint: str | None,
                  tokenizer_class: str | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                  ) -> tuple[Eagle3DraftModel, dict[str, Any]]:
    """From scratch, or from `--finetune-from` with its mismatches reported loudly. Returns (model, info).
    `tokenizer_class`: the class that tokenized the data, recorded for `evaluate`; `chat_template_kwargs`: the
    thinking mode it was rendered in, recorded for the serve lines and `check`."""
    info: dict[str, Any] = {"init": "scratch"}
    config = Eagle3Config.from_verifier(
        verifier_config, draft_vocab_size=int(d2t.numel()), aux_hidden_state_indices=list(aux_indices),
        verifier_name_or_path=model_args.verifier, verifier_revision=model_args.verifier_revision,
        tokenizer_fingerprint=fingerprint, norm_before_residual=model_args.norm_before_residual,
        norm_before_fc=model_args.norm_before_fc, fc_norm=model_args.fc_norm,
        norm_output=model_args.norm_output, sliding_window=model_args.drafter_window,
        verifier_tokenizer_class=tokenizer_class, verifier_chat_template_kwargs=chat_template_kwargs,
    )
    config._attn_implementation = model_args.attn_implementation
    if not model_args.finetune_from:
        model = Eagle3DraftModel(config)
        model.set_vocab_mapping(d2t, t2d)
        return model, info

    source = Eagle3DraftModel.from_pretrained(model_args.finetune_from,
                                              attn_implementation=model_args.attn_implementation)
    src = source.config
    refuse_other_recurrence(model_args.finetune_from, src, config)
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
    theirs = getattr(src, "verifier_chat_template_kwargs", None)
    if theirs is not None and chat_template_kwargs is not None and theirs != chat_template_kwargs:
        info["warnings"].append(f"source drafter was trained on text rendered with chat-template kwargs {theirs}, the "
                                f"data with {chat_template_kwargs} (another thinking mode)")
    for message in info["warnings"]:
        logger.warning("FINETUNE SOURCE MISMATCH: %s", message)
    if model_args.drafter_window is not None and model_args.drafter_window != src.sliding_window:
        logger.warning("--finetune-from %s: attention window %s -> %s (--drafter-window; the weights are unchanged)",
                       model_args.finetune_from, src.sliding_window or "full", model_args.drafter_window)
        source.config.sliding_window = model_args.drafter_window
    elif src.sliding_window is not None:
        logger.info("--finetune-from %s: keeps its %d-token attention window", model_args.finetune_from,
                    src.sliding_window)
    source.config.aux_hidden_state_indices = list(aux_indices)
    source.config.verifier_name_or_path = model_args.verifier
    source.config.verifier_revision = model_args.verifier_revision
    source.config.tokenizer_fingerprint = fingerprint
    source.config.verifier_tokenizer_class = tokenizer_class
    source.config.verifier_chat_template_kwargs = chat_template_kwargs
    if model_args.finetune_vocab == "dataset":
        info["remapped_rows"] = source.remap_lm_head(d2t, t2d)
    return source, info


def refuse_other_recurrence(source_name: str, source: Eagle3Config, target: Eagle3Config) -> None:
    """A source trained with another residual (`norm_before_residual`) or other EAGLE 3.1 options computes another
    function (its residual, its fc input or its recurrence): loading it into this run's drafter would train and
    serve it with the wrong math, silently. Refused in one line that names the flags reproducing the source's
    options; no conversion is lossless (norm_output and norm_before_residual have no weight to drop, and an added
    norm changes what fc reads)."""
    theirs, ours = layer_options(source), layer_options(target)
    if theirs == ours:
        return
    differ = ", ".join(f"{k} {theirs[k]} (this run {ours[k]})" for k in theirs if theirs[k] != ours[k])
    flags = " ".join(f"--{k.replace('_', '-')}" for k, on in theirs.items() if on) or "none of them"
    versions = (f"the source is EAGLE {source.eagle_version} and this run EAGLE {target.eagle_version}"
                if source.eagle_version != target.eagle_version else f"source and run are EAGLE {source.eagle_version}")
    raise ValueError(f"--finetune-from {source_name}: {versions}: {differ}; pass {flags} of --norm-before-residual / "
                     "--norm-before-fc / --fc-norm / --norm-output to finetune it as it was trained, or train from "
                     "scratch")


def layer_options(config: Eagle3Config) -> dict[str, bool]:
    """The options that change what the layer computes from the same weights: the residual and the EAGLE 3.1 three."""
    return {"norm_before_residual": bool(config.norm_before_residual), **config.eagle31_options()}


def finetune_advice(source_acc_0: float) -> str:
    """What the source's step-0 accuracy on the new data, before any training, suggests (logged with
    --finetune-from). Measured, not guessed: see SOURCE_ACC0_LOWEST_THAT_BEAT_SCRATCH."""
    where = "docs/results/finetune_vs_scratch.md; experiments/compare_finetune_vs_scratch.py measures it on your data"
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
