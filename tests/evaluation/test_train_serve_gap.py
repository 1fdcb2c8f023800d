"""The train/serve gap every engine evaluation reports: τ against our decoder's, prompt by prompt."""

from __future__ import annotations

import pytest

from eagle3_hf.evaluation.train_serve_gap import compare_engines


@pytest.mark.parametrize("steps", ["accepted_per_step", "accepted_per_step_cut"])  # llama.cpp's record, vLLM's
def test_compare_engines_tells_numerics_from_real_differences(steps):
    served = {"acceptance_length_as_evaluate_counts": 1.5, "per_prompt": [
        {"tokens": [1, 2, 3], steps: [1, 0]},
        {"tokens": [4, 5, 6], steps: [1, 0]},
        {"tokens": [7, 8, 9], steps: [0, 1]}]}
    ours = {"acceptance_length": 1.25, "per_prompt": [
        {"tokens": [1, 2, 3], "accepted_per_step": [1, 0]},
        {"tokens": [4, 5, 0], "accepted_per_step": [0, 0]},
        {"tokens": [7, 8, 9], "accepted_per_step": [0, 0]}]}
    got = compare_engines(served, ours, steps=steps)
    assert got["prompt_agreement"] == ["equal", "numerics", "differ"] and got["gap"] == pytest.approx(0.25)
    assert (got["prompts_equal"], got["prompts_numerics"], got["prompts_differ"]) == (1, 1, 1)
