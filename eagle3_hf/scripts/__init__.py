"""Scripts shipped with the package (as TRL ships trl/scripts/): the training script users read and run."""
