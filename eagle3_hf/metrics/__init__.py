"""`evaluate` metric modules shipped inside the package (load them by path, e.g.
`evaluate.load(eagle3_hf.speculative.acceptance_metric_path())`)."""

from ..step_metrics import drafter_step_accuracies, simulated_acceptance_length

__all__ = ["drafter_step_accuracies", "simulated_acceptance_length"]
