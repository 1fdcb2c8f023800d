"""Scripts shipped with the package (as TRL ships trl/scripts/): the training script users read and run."""

from __future__ import annotations


def run_training_script(argv: list[str]) -> int:
    """The training script as a process's entry (`accelerate launch examples/train.py ...`): `train.run_script`,
    imported only after a fork of the test suite's warm process (engines/forked.py) has had the chance to run it."""
    from eagle3_hf.engines.forked import run_entry_in_warm

    run_entry_in_warm()
    from eagle3_hf.scripts.train import run_script

    return run_script(argv)
