"""Build, save and run speculators 0.9.0's own EAGLE-3 drafter, for tests/model/test_speculators_roundtrip.py.

Runs inside `.bench-venv/speculators` (`python -m tests.helpers.speculators_drafters`), which cannot import
eagle3_hf; nothing imports it. For each variant of `--variants` (a JSON object: name -> the options its
`Eagle3SpeculatorConfig` takes: `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`) it builds
speculators' `Eagle3DraftModel` on tiny shapes, fills every weight with random values (norm weights around 1,
unevenly, so a norm applied in the wrong place shows), writes it with its own `save_pretrained` to
`OUT/NAME/`, and writes the logits its own forward computes at each TTT step on the row in `OUT/row.safetensors`
to `OUT/NAME.logits.safetensors` (`step_0`, `step_1`, ...: [T, draft_vocab]).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def build(shapes: dict, options: dict, d2t: torch.Tensor, t2d: torch.Tensor, seed: int):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(vocab_size=shapes["vocab_size"], hidden_size=shapes["hidden_size"],
                        intermediate_size=shapes["intermediate_size"], num_hidden_layers=1,
                        num_attention_heads=shapes["num_heads"], num_key_value_heads=shapes["num_kv_heads"],
                        head_dim=shapes["hidden_size"] // shapes["num_heads"], max_position_embeddings=2048,
                        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    layer._attn_implementation = "sdpa"  # its flex-attention default needs a GPU to be fast, not to be right
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=shapes["draft_vocab_size"],
        eagle_aux_hidden_state_layer_ids=shapes["aux_layer_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])),
        **options,
    )
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(t2d, d2t)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # its lm_head and embedding start as NaN: every weight gets a value
            noise = torch.randn(param.shape, generator=g)
            param.copy_(1 + 0.3 * noise if param.dim() == 1 else 0.05 * noise)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory holding row.safetensors and shapes.json")
    parser.add_argument("--variants", required=True, help="JSON: name -> Eagle3SpeculatorConfig options")
    args = parser.parse_args()
    out = Path(args.out)
    torch.set_num_threads(1)
    shapes = json.loads((out / "shapes.json").read_text(encoding="utf-8"))
    row = load_file(str(out / "row.safetensors"))
    for seed, (name, options) in enumerate(json.loads(args.variants).items()):
        model = build(shapes, options, row["d2t"], row["t2d"], seed)
        model.save_pretrained(str(out / name))
        logits: list[torch.Tensor] = []
        hook = model.lm_head.register_forward_hook(lambda _m, _i, o, seen=logits: seen.append(o.detach()[0]))
        with torch.no_grad():  # its forward without verifier states: draft tokens only, teacher-forced inputs
            model(hidden_states=row["hidden_states"], input_ids=row["input_ids"], document_ids=row["document_ids"],
                  position_ids=row["position_ids"], ttt_steps=shapes["ttt_steps"])
        hook.remove()
        save_file({f"step_{i}": step.contiguous() for i, step in enumerate(logits)},
                  str(out / f"{name}.logits.safetensors"))


if __name__ == "__main__":
    main()
