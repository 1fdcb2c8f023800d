"""The serving engines and the drafter kinds, one row each: the one place that names them.

An engine row says what the project does with that engine: whether `eagle3-hf evaluate --engine NAME` serves the
drafter in it, what `eagle3-hf check --endpoint` reads from a running server of it, and whether it loads the
checkpoint directory itself (SGLang and vLLM, by repo id: `check --engine all` means them) or a file converted from
it (llama.cpp's GGUF). A kind row gives the name each engine's flag takes for that kind of drafter, and the
`architectures` of a checkpoint's config.json say which kind it is. `evaluation/command.py`,
`evaluation/vllm_engine.py`, `evaluation/llamacpp_engine.py`, `evaluation/live_check.py`, `publish/report.py`,
`publish/check.py`, `publish/export.py` and `publish/model_card.py` read these rows; `vllm_runner.py`, which imports
nothing of the package, gets the method in its request.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ServingEngine:
    name: str  # the `--engine` value of evaluate and check
    label: str  # how messages name it
    loads_checkpoint: bool  # serves the drafter's directory (or repo id) itself; else a file converted from it
    evaluate: bool  # `evaluate --engine NAME` serves the drafter in this engine beside our decoder
    live_counters: str | None  # what `check --endpoint` reads from a running server; None: no live check


ENGINES: tuple[ServingEngine, ...] = (
    ServingEngine("sglang", "SGLang", loads_checkpoint=True, evaluate=False,
                  live_counters="spec_verify_ct and spec_correct_drafts_histogram (return_spec_tokens_details)"),
    ServingEngine("vllm", "vLLM", loads_checkpoint=True, evaluate=True,
                  live_counters="vllm:spec_decode_num_drafts and vllm:spec_decode_num_accepted_tokens_per_pos "
                                "(/metrics)"),
    ServingEngine("llamacpp", "llama.cpp", loads_checkpoint=False, evaluate=True, live_counters=None),
)


@dataclass(frozen=True)
class DrafterKind:
    name: str
    label: str
    architectures: tuple[str, ...]  # what config.json's `architectures` holds for this kind (a prefix matches too)
    vllm_method: str  # speculative_config "method"
    sglang_algorithm: str  # --speculative-algorithm
    llamacpp_spec_type: str  # llama-server --spec-type
    model: str  # "module:Class" of its PreTrainedModel, imported when asked for (this table imports no torch)
    training: str  # "module:Class" of how the Trainer trains it (train/kind_training.py: KindTraining)
    decoder: str  # "module:function" decoding with it in our decoder (decoding/kind_decoders.py)
    plan: str  # "module:function" of `eagle3-hf plan`'s arithmetic for it (train/plan_drafter.py)
    checks: str  # "module:function" of `eagle3-hf check`'s rules for its checkpoints (publish/check.py)

    def model_class(self) -> Any:
        """The drafter's PreTrainedModel class (`from_pretrained` reads this kind's layout)."""
        return _imported(self.model)

    def training_class(self) -> Any:
        """Its KindTraining: the loss items, loss and metric counts of one micro-batch, for the Trainer."""
        return _imported(self.training)

    def decoder_function(self) -> Any:
        """Speculative decoding with a drafter of this kind (decoding/kind_decoders.py's signature)."""
        return _imported(self.decoder)

    def plan_function(self) -> Any:
        """(recipe, verifier text config, draft vocabulary) -> the plan's DrafterArithmetic for this kind."""
        return _imported(self.plan)

    def checks_function(self) -> Any:
        """`check`'s rules for a checkpoint of this kind (publish/check.py's KindChecks signature)."""
        return _imported(self.checks)


def _imported(where: str) -> Any:
    module, name = where.split(":")
    return getattr(importlib.import_module(module), name)


EAGLE3 = DrafterKind("eagle3", "EAGLE-3", ("LlamaForCausalLMEagle3", "Eagle3"), vllm_method="eagle3",
                     sglang_algorithm="EAGLE3", llamacpp_spec_type="draft-eagle3",
                     model="eagle3_hf.model.modeling_eagle3:Eagle3DraftModel",
                     training="eagle3_hf.train.chain_training:ChainTraining",
                     decoder="eagle3_hf.decoding.kind_decoders:decode_chain_or_tree",
                     plan="eagle3_hf.train.plan_drafter:eagle3_arithmetic",
                     checks="eagle3_hf.publish.check:check_eagle3")
DFLASH = DrafterKind("dflash", "DFlash", ("DFlashDraftModel", "DFlash"), vllm_method="dflash",
                     sglang_algorithm="DFLASH", llamacpp_spec_type="draft-dflash",
                     model="eagle3_hf.model.modeling_dflash:DFlashDraftModel",
                     training="eagle3_hf.train.dflash_training:BlockTraining",
                     decoder="eagle3_hf.decoding.kind_decoders:decode_blocks",
                     plan="eagle3_hf.train.plan_drafter:dflash_arithmetic",
                     checks="eagle3_hf.publish.check:check_dflash")
KINDS: tuple[DrafterKind, ...] = (EAGLE3, DFLASH)


def engine_row(name: str) -> ServingEngine:
    """The row of engine `name`; ValueError naming the known ones otherwise."""
    for row in ENGINES:
        if row.name == name:
            return row
    raise ValueError(f"unknown serving engine {name!r}: expected one of {', '.join(engine_names())}")


def engine_names() -> tuple[str, ...]:
    return tuple(row.name for row in ENGINES)


def checkpoint_engines() -> tuple[str, ...]:
    """The engines that load the checkpoint directory itself (`check --engine all`)."""
    return tuple(row.name for row in ENGINES if row.loads_checkpoint)


def evaluated_engines() -> tuple[str, ...]:
    """The engines `evaluate --engine` serves a drafter in."""
    return tuple(row.name for row in ENGINES if row.evaluate)


def live_engines() -> tuple[str, ...]:
    """The engines whose running servers `check --endpoint` reads."""
    return tuple(row.name for row in ENGINES if row.live_counters)


def kind(name: str) -> DrafterKind:
    for row in KINDS:
        if row.name == name:
            return row
    raise ValueError(f"unknown drafter kind {name!r}: expected one of {', '.join(kind_names())}")


def kind_names() -> tuple[str, ...]:
    return tuple(row.name for row in KINDS)


def drafter_kind(config: dict[str, Any]) -> DrafterKind:
    """The kind a checkpoint's config.json declares by its `architectures`. EAGLE-3 unless an architecture names
    another kind: vLLM serves an EAGLE-3 drafter whatever its architectures say (the method picks the class), so an
    export without them, or with `LlamaForCausalLM`, stays one."""
    names = [str(a) for a in config.get("architectures") or []]
    for row in KINDS:
        if row is not EAGLE3 and any(a.startswith(p) for a in names for p in row.architectures):
            return row
    return EAGLE3


def checkpoint_kind(path: str | os.PathLike) -> DrafterKind:
    """`drafter_kind` of the config.json in directory `path`; EAGLE-3 when there is none to read (a Hub repo id
    not downloaded: the callers that need the files fetch them)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return EAGLE3
    return drafter_kind(json.loads(config.read_text(encoding="utf-8")))
