"""Old import path, kept working: `eagle3_hf.configuration_eagle3` is `eagle3_hf.model.configuration_eagle3`
(the same module object)."""

import sys

from .model import configuration_eagle3

sys.modules[__name__] = configuration_eagle3
