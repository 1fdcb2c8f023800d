"""eagle3_hf: train EAGLE-3 draft models as Hugging Face models, for SGLang and vLLM."""

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Eagle3Config", "Eagle3DraftModel"]

if TYPE_CHECKING:
    from .model.configuration_eagle3 import Eagle3Config
    from .model.modeling_eagle3 import Eagle3DraftModel


def __getattr__(name: str):
    # Lazy: `eagle3-hf --help` and the data stages should not pay for importing torch + transformers.
    if name == "Eagle3Config":
        from .model.configuration_eagle3 import Eagle3Config

        return Eagle3Config
    if name == "Eagle3DraftModel":
        from .model.modeling_eagle3 import Eagle3DraftModel

        return Eagle3DraftModel
    raise AttributeError(name)
