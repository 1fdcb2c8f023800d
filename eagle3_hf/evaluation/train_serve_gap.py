"""The train/serve gap: an engine's τ and per-prompt acceptance against our decoder's on the same prompts, one
comparison for every engine `evaluate --engine` serves in (vLLM, llama.cpp)."""

from __future__ import annotations

from typing import Any


def compare_engines(served: dict[str, Any], transformers: dict[str, Any],
                    steps: str = "accepted_per_step") -> dict[str, Any]:
    """gap = the engine's τ counted as evaluate counts it minus evaluate's τ: zero when the engine accepts exactly
    what our decoder accepts. Per prompt: "equal" (same tokens, same accepted drafts at every step; the engine's
    per-step record is `steps`, vLLM's with its final step cut), "numerics" (the greedy outputs differ, at a
    near-tie of the two engines' kernels or weights: the steps are not comparable) or "differ" (same tokens,
    different acceptance: a real train/serve mismatch)."""
    tau_s, tau_t = served["acceptance_length_as_evaluate_counts"], transformers["acceptance_length"]
    kinds = []
    for s, t in zip(served["per_prompt"], transformers["per_prompt"]):
        if s["tokens"] != t.get("tokens", s["tokens"]):
            kinds.append("numerics")
        else:
            kinds.append("equal" if s[steps] == list(t["accepted_per_step"]) else "differ")
    return {"transformers_acceptance_length": tau_t,
            "gap": tau_s - tau_t if tau_s is not None and tau_t is not None else None,
            "prompts_equal": kinds.count("equal"), "prompts_numerics": kinds.count("numerics"),
            "prompts_differ": kinds.count("differ"), "num_compared": len(kinds), "prompt_agreement": kinds}
