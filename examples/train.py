#!/usr/bin/env python
"""Train an EAGLE-3 drafter: `accelerate launch examples/train.py --features feats/ --output-dir runs/drafter`.

The training script ships inside the package, so that `eagle3-hf train` works from an installed wheel; read
it at eagle3_hf/scripts/train.py (one page, top to bottom: arguments, datasets, drafter, teacher, Trainer,
save). This file runs it, so every `accelerate launch examples/train.py ...` command in the docs keeps working.
"""

import sys

from eagle3_hf.scripts import run_training_script

if __name__ == "__main__":
    sys.exit(run_training_script(sys.argv[1:]))
