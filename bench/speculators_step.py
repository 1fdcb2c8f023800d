"""One training step of speculators' own EAGLE-3 drafter, for bench/train_step.py (never imported by it).

Runs inside `.bench-venv/speculators` (speculators 0.9.0, its own transformers), in a fresh process per
measurement. It builds speculators' `Eagle3DraftModel` on the shapes in --spec, fills the weights its
`load_verifier_weights` would (embedding, frozen `lm_head` / `verifier_lm_head` = the verifier's rows for
the draft vocabulary, `verifier_norm`), and runs what its trainer runs per batch: forward with the TTT
unroll and its eager KL loss + metrics, backward, `clip_grad_norm_(1.0)`, AdamW step (its `build_optimizers`
with `optimizer="adamw"`), zero_grad. Batch-1 rows only (its forward squeezes the batch dimension), so the
padded layout runs one row per micro-step and steps the optimizer once. Writes one JSON result.
"""

from __future__ import annotations

import argparse
import json
import resource
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from bench.step_timing import measure_steps, rss_mib


def build_drafter(m: dict, attn: str, ttt_steps: int, d2t: torch.Tensor, t2d: torch.Tensor, embed: torch.Tensor,
                  head_rows: torch.Tensor, aux_layer_ids=(2, 15, 27), verifier: str | None = None):
    """speculators' `Eagle3DraftModel` on the shapes in `m`, with what its `load_verifier_weights` copies in
    (embedding, `lm_head` = `verifier_lm_head` = the verifier's rows of the draft vocabulary), frozen as it
    trains them. The standard EAGLE-3 layer: no extra norms (`norm_before_fc`, `norm_output` off)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer_config = LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
        head_dim=m["head_dim"], max_position_embeddings=m["max_position_embeddings"],
        rms_norm_eps=m.get("rms_norm_eps", 1e-5), rope_theta=m.get("rope_theta", 10000.0),
        tie_word_embeddings=False,
    )
    layer_config._attn_implementation = attn
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=m["draft_vocab_size"],
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=["LlamaForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(t2d, d2t)
    model.embed_tokens.load_state_dict({"weight": embed})
    model.lm_head.load_state_dict({"weight": head_rows})
    model.verifier_lm_head.load_state_dict({"weight": head_rows})
    for p in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight,
              model.verifier_norm.weight):
        p.requires_grad_(False)
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--batch", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = json.loads(open(args.spec, encoding="utf-8").read())
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)

    import speculators
    from speculators.losses import resolve_loss_config
    from speculators.train.optimizers import build_optimizers

    rss_imports = rss_mib("VmRSS")
    m = spec["model"]
    data = load_file(args.batch)
    # the verifier's embedding and lm_head rows (same values as our side's)
    embed = torch.randn(m["vocab_size"], m["hidden_size"], generator=torch.Generator().manual_seed(1)) * 0.02
    rows = torch.randn(m["draft_vocab_size"], m["hidden_size"], generator=torch.Generator().manual_seed(2)) * 0.02
    model = build_drafter(m, spec["attn"], spec["ttt_steps"], data["d2t"], data["t2d"], embed, rows)
    del embed, rows
    model.train()
    loss_config = resolve_loss_config("kl_div", "eager")  # the fused loss is Triton, GPU only
    optimizers = build_optimizers(model, SimpleNamespace(optimizer="adamw", lr=1e-4, weight_decay=0.01))
    trainable = [p for p in model.parameters() if p.requires_grad]

    prefix = "padded." if spec["layout"] == "padded" else ""  # the packed row has no prefix
    names = ("input_ids", "aux_hidden_states", "last_hidden_state", "verifier_greedy", "document_ids", "position_ids",
             "loss_mask")
    rows_in = {k: data[prefix + k] for k in names}
    num_rows = rows_in["input_ids"].shape[0]
    real_tokens = int((rows_in["document_ids"] != -1).sum())

    def micro(b: dict, num: int) -> None:
        _draft, loss, _metrics = model(
            hidden_states=b["aux_hidden_states"], input_ids=b["input_ids"], document_ids=b["document_ids"],
            loss_mask=b["loss_mask"].bool(), position_ids=b["position_ids"],
            verifier_last_hidden_states=b["last_hidden_state"], ttt_steps=spec["ttt_steps"],
            ttt_step_loss_decay=spec["step_weight"], loss_config=loss_config,
        )
        (loss / num).backward()  # its loss is a per-row mean: average over the accumulated rows

    def step(batches: list[dict]) -> None:
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for b in batches:
            micro(b, len(batches))
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        for opt in optimizers:
            opt.step()

    times, peak_step, profile = measure_steps(step, rows_in, spec)
    result = {
        "impl": "speculators", "version": speculators.__version__ if hasattr(speculators, "__version__") else "0.9.0",
        "times": times, "real_tokens": real_tokens, "rows": num_rows,
        "peak_step_mib": peak_step, "rss_imports_mib": rss_imports, "profile": profile,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trainable_params": sum(p.numel() for p in trainable),
        "lm_head_trainable": bool(model.lm_head.weight.requires_grad),
    }
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
