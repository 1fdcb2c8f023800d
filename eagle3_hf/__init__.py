"""eagle3_hf: train EAGLE-3 draft models as Hugging Face models, for SGLang and vLLM."""

from .configuration_eagle3 import Eagle3Config
from .modeling_eagle3 import Eagle3DraftModel

__all__ = ["Eagle3Config", "Eagle3DraftModel"]
__version__ = "0.1.0"
