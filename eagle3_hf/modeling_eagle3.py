"""Old import path, kept working: `eagle3_hf.modeling_eagle3` is `eagle3_hf.model.modeling_eagle3` (the same
module object)."""

import sys

from .model import modeling_eagle3

sys.modules[__name__] = modeling_eagle3
