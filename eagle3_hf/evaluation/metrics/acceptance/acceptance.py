"""Acceptance statistics of speculative decoding, as an `evaluate` metric.

Stand-alone on purpose (evaluate copies this file into its module cache; it imports nothing from
eagle3_hf), so it can also be published as a Space. Load it offline from the installed package:

    import evaluate
    from eagle3_hf.decoding.stats import acceptance_metric_path
    metric = evaluate.load(acceptance_metric_path())
    metric.compute(accepted=[3, 1, 0], drafted=[3, 3, 3])
"""

import datasets
import evaluate

_DESCRIPTION = """
Acceptance statistics of chain speculative decoding (EAGLE-3 style) from recorded verifier steps. Each
record is one verifier forward: `drafted` draft tokens were proposed, the first `accepted` of them were
accepted, and the verifier added one token of its own (the bonus or the correction).

- acceptance_length (tau): mean of accepted + 1 per verifier forward, at most k + 1.
- per_position_acceptance[j-1]: unconditional acceptance of draft position j, the share of steps that
  drafted at least j tokens in which the first j were all accepted (None where no step drafted j).
- accepted_histogram[a]: number of steps that accepted exactly a drafts (a = 0..k).
"""

_KWARGS_DESCRIPTION = """
Args:
    accepted (`list[int]`): accepted draft tokens per verifier forward.
    drafted (`list[int]`): draft tokens proposed at that forward (k, or fewer near max_new_tokens).
    k (`int`, optional): draft length; defaults to max(drafted).
Returns:
    acceptance_length (`float`), per_position_acceptance (`list[float | None]`), accepted_histogram
    (`list[int]`), num_steps (`int`).
Examples:
    >>> metric = evaluate.load(acceptance_metric_path())
    >>> metric.compute(accepted=[3, 1], drafted=[3, 3])["acceptance_length"]
    3.0
"""

_CITATION = """
@inproceedings{li2025eagle3,
  title={{EAGLE-3}: Scaling up Inference Acceleration of Large Language Models via Training-Time Test},
  author={Li, Yuhui and Wei, Fangyun and Zhang, Chao and Zhang, Hongyang},
  booktitle={NeurIPS},
  year={2025}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Acceptance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"accepted": datasets.Value("int32"), "drafted": datasets.Value("int32")}),
        )

    def _compute(self, accepted, drafted, k=None):
        accepted = [int(a) for a in accepted]
        drafted = [int(d) for d in drafted]
        if any(a < 0 or a > d for a, d in zip(accepted, drafted)):
            raise ValueError("each record needs 0 <= accepted <= drafted")
        k = int(k) if k is not None else max(drafted, default=0)
        steps = len(accepted)
        per_position = []
        for j in range(1, k + 1):
            offered = [a for a, d in zip(accepted, drafted) if d >= j]
            per_position.append(sum(a >= j for a in offered) / len(offered) if offered else None)
        return {
            "acceptance_length": (sum(accepted) + steps) / steps if steps else None,
            "per_position_acceptance": per_position,
            "accepted_histogram": [accepted.count(a) for a in range(k + 1)],
            "num_steps": steps,
        }
