"""eagle3_hf: train EAGLE-3 draft models as Hugging Face models, for SGLang and vLLM.

The names a training composed in Python needs (README.md, "Python API") are importable from here, as
`from trl import SFTTrainer, SFTConfig` is: `from eagle3_hf import Eagle3DraftModel, Eagle3Trainer, ...`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module defining it. Imported on first use: `eagle3-hf --help` and the data stages must not
# pay for torch + transformers.
_EXPORTS = {
    "Eagle3Config": "eagle3_hf.model.configuration_eagle3",
    "Eagle3DraftModel": "eagle3_hf.model.modeling_eagle3",
    "Eagle3Trainer": "eagle3_hf.train.trainer",
    "Eagle3TrainingArguments": "eagle3_hf.train.arguments",
    "FeatureDataset": "eagle3_hf.features.reader",
    "PackedDataset": "eagle3_hf.features.packing",
    "PackedCollator": "eagle3_hf.features.packing",
    "load_vocab": "eagle3_hf.data.vocab",
    "verifier_io_weights": "eagle3_hf.verifier.checkpoint_files",
}
# spelled out, not list(_EXPORTS): type checkers and linters read `__all__` only as a literal
__all__ = ["Eagle3Config", "Eagle3DraftModel", "Eagle3Trainer", "Eagle3TrainingArguments", "FeatureDataset",
           "PackedDataset", "PackedCollator", "load_vocab", "verifier_io_weights"]

if TYPE_CHECKING:
    from .data.vocab import load_vocab
    from .features.packing import PackedCollator, PackedDataset
    from .features.reader import FeatureDataset
    from .model.configuration_eagle3 import Eagle3Config
    from .model.modeling_eagle3 import Eagle3DraftModel
    from .train.arguments import Eagle3TrainingArguments
    from .train.trainer import Eagle3Trainer
    from .verifier.checkpoint_files import verifier_io_weights


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
