"""The training script's arguments: three HfArgumentParser dataclasses, one page.

`Eagle3TrainingArguments` is TrainingArguments plus the TTT knobs; `ModelArguments` names the verifier and the
drafter's starting point; `DataArguments` the features and how they are packed. `--config FILE.yaml|json`
supplies defaults for any of them, which the command line overrides.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import HfArgumentParser, TrainingArguments
from transformers.hf_argparser import DataClassType

from ..engines.table import KINDS
from ..errors import UsageError
from ..features.table import features_syntax
from ..model.configuration_dflash import DEFAULT_BLOCK_SIZE, DEFAULT_LAYERS, DEFAULT_LOSS_DECAY
from ..model.configuration_eagle3 import Eagle3Config
from .objective import DEFAULT_LK_ETA, OBJECTIVES, Objective


@dataclass
class Eagle3TrainingArguments(TrainingArguments):
    """TrainingArguments plus the TTT knobs; defaults select checkpoints by simulated acceptance length
    (τ peaks while the loss keeps falling, so loss is the wrong criterion)."""

    ttt_steps: int = field(default=Eagle3Config.ttt_steps,
                           metadata={"help": "training-time-test steps unrolled per batch"})
    ttt_step_weight: float = field(default=Eagle3Config.ttt_step_weight,
                                   metadata={"help": "step i of the unroll is weighted gamma^i"})
    objective: str = field(
        default="kl", metadata={"help": "what each position of the unroll trains: kl (soft cross-entropy against the "
                                        "verifier's distribution on the draft vocabulary), lk-alpha (-log α, α = "
                                        "Σ min(p, q) the acceptance rate over the full vocabulary) or lk-hybrid "
                                        "(w KL + (1 - w)(1 - α), w = exp(-η α)); the LK losses keep the verifier's "
                                        "whole lm_head for its mass outside the draft vocabulary",
                                "choices": list(OBJECTIVES)})
    lk_eta: float = field(default=DEFAULT_LK_ETA, metadata={"help": "lk-hybrid's η in w = exp(-η α): 0 is kl, larger "
                                                                    "hands the loss to 1 - α sooner"})
    feature_noise_std: float = field(
        default=0.0, metadata={"help": "std of Gaussian noise added to verifier features while training"}
    )
    hidden_optimizer: str = field(
        default="adamw", metadata={"help": "optimizer for the 2-D hidden weights (attention, MLP, fc); muon keeps "
                                           "AdamW for embeddings, lm_head and norms", "choices": ["adamw", "muon"]}
    )
    init_lm_head: str = field(
        default="random",
        metadata={"help": "lm_head at the start: 'random', or 'verifier' (the verifier's rows for the draft "
                          "vocabulary, in d2t order)", "choices": ["random", "verifier"]},
    )
    freeze_lm_head: bool = field(
        default=False, metadata={"help": "keep lm_head fixed (no gradient, no optimizer state): with "
                                         "--init-lm-head verifier, speculators' recipe"}
    )
    packed_attention: str = field(
        default="auto", metadata={"help": "TTT attention over packed rows: 'row' (one call per step over the batch, no "
                                          "host synchronisation: the accelerator path), 'document' (one call per "
                                          "document and step: less arithmetic, faster on a CPU), 'auto' (document "
                                          "on the CPU, row elsewhere)", "choices": ["auto", "row", "document"]}
    )
    shm_check: str = field(
        default="refuse", metadata={"help": "/dev/shm against what the data-loader workers need at peak "
                                            "(eagle3_hf/train/shm.py), at start: refuse (one line saying what to "
                                            "change), warn, or off", "choices": ["refuse", "warn", "off"]}
    )
    load_best_model_at_end: bool | None = field(  # type: ignore[assignment]  # None: decided in __post_init__
        default=None, metadata={"help": "keep the checkpoint with the best --metric-for-best-model (simulated "
                                        "acceptance length) at the end; default: on wherever evaluation runs and the "
                                        "save strategy matches it (a validation split, the default), else off"})
    metric_for_best_model: str | None = field(default="simulated_acceptance_length")
    greater_is_better: bool | None = field(default=True)
    remove_unused_columns: bool = field(default=False)
    save_safetensors: bool = field(default=True)
    # transformers' default replaces a NaN/Inf step loss by the window's mean: the log would hide it
    logging_nan_inf_filter: bool = field(default=False)
    # every trained parameter gets a gradient at every step (the embedding and a frozen lm_head are not trained),
    # so DDP needs no extra pass over the graph to find unused ones
    ddp_find_unused_parameters: bool | None = field(default=False)

    def __post_init__(self) -> None:
        refuse_unsupported(bool(self.gradient_checkpointing), self.hidden_optimizer, bool(self.deepspeed))
        self.training_objective()  # an unknown objective or a bad η: refused here, in one line
        if self.load_best_model_at_end is None:
            self.load_best_model_at_end = best_model_selectable(self.eval_strategy, self.save_strategy,
                                                                self.eval_steps or self.logging_steps, self.save_steps)
        super().__post_init__()  # type: ignore[no-untyped-call]  # unannotated in transformers


    def training_objective(self) -> Objective:
        """The run's per-row objective (train/objective.py)."""
        return Objective(self.objective, self.lk_eta)


def best_model_selectable(eval_strategy: Any, save_strategy: Any, eval_steps: float, save_steps: float) -> bool:
    """Whether the best checkpoint can be kept: evaluation runs, and every evaluation has a checkpoint to keep
    (transformers' condition for load_best_model_at_end). Selection by simulated τ is then the default, since
    over-training lowers τ while the loss keeps falling."""
    def name(strategy: Any) -> str:
        return str(getattr(strategy, "value", strategy))

    if name(eval_strategy) == "no" or name(eval_strategy) != name(save_strategy):
        return False
    return name(eval_strategy) != "steps" or (eval_steps > 0 and save_steps % eval_steps == 0)


def refuse_unsupported(gradient_checkpointing: bool, hidden_optimizer: str, deepspeed: bool) -> None:
    """One-line refusals of combinations that would otherwise fail deep inside a run or be silently changed."""
    if gradient_checkpointing:
        raise ValueError("--gradient_checkpointing is not supported: the drafter has one layer, whose activations "
                         "are what the TTT unroll reuses; lower --max-seq-len or the batch size instead")
    if hidden_optimizer == "muon" and deepspeed:
        raise ValueError("--hidden-optimizer muon cannot run under DeepSpeed (it builds the optimizer its config "
                         "names): train Muon with DDP, or drop --hidden-optimizer with a DeepSpeed config")


@dataclass
class ModelArguments:
    drafter_kind: str = field(
        default="eagle3", metadata={"help": "eagle3: one layer drafting a chain, token by token; dflash: a block "
                                            "drafter (DFlash) drafting --block-size - 1 tokens per forward, from the "
                                            "same features", "choices": [k.name for k in KINDS]})
    block_size: int = field(
        default=DEFAULT_BLOCK_SIZE, metadata={"help": "dflash: tokens per block, the anchor included (drafts per "
                                                      "verify forward: block size - 1)"})
    dflash_layers: int = field(default=DEFAULT_LAYERS, metadata={"help": "dflash: decoder layers of the drafter"})
    mask_token_id: int | None = field(
        default=None, metadata={"help": "dflash: the token fed at masked block positions; must not occur in the "
                                        "data (default: the tokenizer's highest unused special token)"})
    block_loss_decay: float = field(
        default=DEFAULT_LOSS_DECAY, metadata={"help": "dflash: block position k's loss is weighted "
                                                      "exp(-(k - 1) / decay)"})
    dflash_anchors: int = field(
        default=64, metadata={"help": "dflash: blocks per packed row, anchored at random assistant positions"})
    verifier: str | None = field(
        default=None, metadata={"help": "verifier name, path or repo id (default: the one --features names, "
                                        "else smollm2-135m-instruct); the features' verifier must be it"})
    verifier_revision: str | None = field(default=None)
    trust_remote_code: bool = field(
        default=False, metadata={"help": "run the Python code the verifier or its tokenizer ships (auto_map); off by "
                                         "default: only for checkpoints you trust"})
    finetune_from: str | None = field(
        default=None, metadata={"help": "initialise from this drafter (directory or Hub repo id, any layout)"}
    )
    finetune_vocab: str = field(
        default="source",
        metadata={"help": "source: keep the source's d2t/t2d (dataset targets follow it); dataset: use the "
                          "dataset's vocabulary and remap lm_head rows explicitly", "choices": ["source", "dataset"]},
    )
    attn_implementation: str = field(default="sdpa", metadata={"choices": ["sdpa", "eager", "flex_attention"]})
    norm_before_residual: bool = field(
        default=False, metadata={"help": "the layer's residual is the normed hidden state, hidden_norm(h), instead of "
                                         "h (speculators' training default); vLLM serves it, SGLang does not "
                                         "(eagle3-hf check)"})
    norm_before_fc: bool = field(
        default=False, metadata={"help": "EAGLE 3.1: one RMSNorm over the concatenated aux input before fc "
                                         "(input_norm.weight); vLLM and SGLang 0.5.17+ serve it (eagle3-hf check)"})
    fc_norm: bool = field(
        default=False, metadata={"help": "EAGLE 3.1: one RMSNorm per aux state before fc (fc_norm.{i}.weight); "
                                         "excludes --norm-before-fc"})
    norm_output: bool = field(
        default=False, metadata={"help": "EAGLE 3.1: the next TTT / draft step reads the post-norm state"})
    drafter_window: int | None = field(
        default=None, metadata={"help": "sliding-window attention: the drafter sees only the last N tokens, in "
                                        "training and decoding (exported as vLLM reads it; eagle3-hf check says who "
                                        "serves it). Default: full attention, or the --finetune-from source's window"})


@dataclass
class DataArguments:
    features: str | None = field(
        default=None, metadata={"help": f"where the features come from: {features_syntax()}"})
    prepared_dir: str | None = field(default=None, metadata={"help": "prepared dataset, for online --features"})
    features_dtype: str | None = field(
        default=None, metadata={"help": "with a server (ours or SGLang): features rounded as a shard of "
                                        "this dtype stores them (bf16, fp8, fp32; default bf16, as `extract`)"})
    cache_features: str | None = field(
        default=None, metadata={"help": "with an online --features: keep the fetched features in this directory "
                                        "(extract's shard format) and read them from there in later epochs and "
                                        "reruns, instead of asking the server again"})
    online_timeout: float = field(default=600.0, metadata={"help": "seconds one feature request may take"})
    online_retries: int = field(default=3, metadata={"help": "retries of a feature request that timed out or "
                                                              "found the server down, before the run stops"})
    allow_partial_features: bool = field(
        default=False, metadata={"help": "train on an unfinished extraction's samples (--features DIR without its "
                                         "manifest.json), with a warning saying how many, instead of refusing it"})
    per_node_features: bool = field(
        default=False, metadata={"help": "over several nodes, where --features DIR is local to each node: each "
                                         "node trains on its own part of the extraction (`extract "
                                         "--per-node-output`), or reads its own copy (default: every node must "
                                         "read the same features; checked at launch)"})
    verify_features: str = field(
        default="once", metadata={"help": "shard checksums of a feature directory, checked by each node's main "
                                          "process after every check that needs no shard bytes: once (a shard is "
                                          "hashed unless its writer or an earlier start, recorded in "
                                          "verified.json, vouches for the file on disk: same size, mtime, ctime "
                                          "and inode), always (every shard at every start), never (sizes only)",
                                  "choices": ["once", "always", "never"]})
    verify_threads: int = field(
        default=0, metadata={"help": "threads hashing shards (0: the machine's cores, at most 16); more can help "
                                     "a network filesystem"})
    vocab: str | None = field(default=None, metadata={"help": "vocab.safetensors (default: in the feature or "
                                                                      "prepared directory)"})
    max_seq_len: int = field(default=2048)
    packing: bool = field(default=True)
    overlong: str = field(default="truncate", metadata={"choices": ["truncate", "split", "error"]})
    validation_fraction: float = field(default=0.05)
    max_train_tokens: int | None = field(
        default=None, metadata={"help": "train on whole training samples up to this many tokens, a seeded shuffle "
                                        "stratified by prompt source, nested across budgets (a feature directory; the "
                                        "validation split is unchanged) — for data-scaling curves"}
    )
    config: str | None = field(default=None, metadata={"help": "YAML/JSON file of defaults for any argument"})


def loader_defaults(cuda: bool) -> dict[str, Any]:
    """DataLoader settings that keep GPUs fed: with CUDA, worker processes (a node's cores shared by its ranks)
    that stay alive across epochs and read ahead, into pinned memory; on the CPU the training processes already
    use the cores, so batches are read in the main process."""
    if not cuda:
        return {"dataloader_num_workers": 0}
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or torch.cuda.device_count() or 1)
    return {"dataloader_num_workers": max(1, min(4, (os.cpu_count() or 2) // ranks)), "dataloader_pin_memory": True,
            "dataloader_persistent_workers": True, "dataloader_prefetch_factor": 4}


# the script's defaults over TrainingArguments' own (those that depend on the machine are set in parse_args)
SCRIPT_DEFAULTS: dict[str, Any] = {"report_to": "none", "logging_steps": 10, "eval_strategy": "epoch",
                                   "save_strategy": "epoch", "save_total_limit": 2}


def build_parser(prog: str | None = None) -> HfArgumentParser:
    """The three argument groups' parser with the script's machine-independent defaults (the CLI reference's)."""
    # transformers types the dataclasses as a NewType over Any, and the parsed tuple as tuple[DataClass, ...]
    parser = HfArgumentParser(cast(tuple[DataClassType, ...], (ModelArguments, DataArguments, Eagle3TrainingArguments)),
                              prog=prog)
    parser.set_defaults(**SCRIPT_DEFAULTS)
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, Eagle3TrainingArguments]:
    """The three argument groups from the command line, over `--config` defaults; `--help` lists them all."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {**SCRIPT_DEFAULTS, **loader_defaults(torch.cuda.is_available()),
                # no GPU: train on the CPU, over gloo when launched with several processes
                "use_cpu": not torch.cuda.is_available()}
    if "--config" in argv:
        path = argv[argv.index("--config") + 1]
        with open(path, encoding="utf-8") as f:
            if path.endswith((".yaml", ".yml")):
                import yaml

                loaded = yaml.safe_load(f) or {}
            else:
                loaded = json.load(f)
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise UsageError(f"{path}: unknown keys {unknown}")
        defaults.update(loaded)
    parser.set_defaults(**defaults)
    asks_help = "-h" in argv or "--help" in argv
    if not asks_help and "--output_dir" not in argv and "--output-dir" not in argv and "output_dir" not in defaults:
        raise UsageError("--output-dir is required")
    return cast(tuple[ModelArguments, DataArguments, Eagle3TrainingArguments],
                parser.parse_args_into_dataclasses(args=argv))
