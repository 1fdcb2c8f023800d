"""Train speculators 0.9.0's EAGLE-3 drafter on batches dumped by experiments/quality_vs_speculators.py (never
imported by it; runs inside `.bench-venv/speculators`, which cannot import eagle3_hf).

Its recipe as its `speculators train` CLI sets it for eagle3 (0.9.0 defaults): its `Eagle3DraftModel` with the
verifier's embedding and lm_head rows frozen, its eager KL loss over the draft vocabulary, TTT 3 steps with
step weight (`ttt_step_loss_decay`) 1.0, its `build_optimizers` (Muon on the hidden matrices + AdamW on the
rest, lr 1e-3), a linear schedule with 1 % warm-up, `clip_grad_norm_(1.0)` — and its data convention: each
document goes through its own `shift_batch` (token t+1, feature t, teacher t+1, loss mask t+1), the
documents of one of our batches form one packed row (its forward takes batch-1 rows). Then its
`save_pretrained` writes the speculators layout (`layers.0.*`, the embedding included).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file, save_file

from bench.speculators_step import build_drafter


def speculators_row(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our batch (real tokens of its rows back to back, `document_ids` unique per document) -> its packed
    row [1, T]: each document shifted by its own `shift_batch`, then concatenated."""
    from speculators.models.eagle3.data import shift_batch

    docs = []
    for d in batch["document_ids"].unique_consecutive().tolist():
        sel = batch["document_ids"] == d
        n = int(sel.sum())
        if n < 2:
            continue  # nothing to predict once shifted
        docs.append(shift_batch({
            "input_ids": batch["input_ids"][sel], "hidden_states": batch["aux_hidden_states"][sel],
            "verifier_last_hidden_states": batch["last_hidden_state"][sel], "loss_mask": batch["loss_mask"][sel],
            "lengths": torch.tensor([n]), "position_ids": batch["position_ids"][sel],
        }))
    row = {k: torch.cat([doc[k] for doc in docs]).unsqueeze(0) for k in
           ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids")}
    row["document_ids"] = torch.cat([torch.full((int(doc["lengths"]),), i)
                                     for i, doc in enumerate(docs)]).unsqueeze(0)
    row["loss_mask"] = row["loss_mask"].bool()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", required=True,
                        help="directory with spec.json, verifier.safetensors and batch-*.safetensors")
    parser.add_argument("--out", required=True, help="checkpoint directory (speculators layout)")
    args = parser.parse_args()
    work = Path(args.work)
    spec = json.loads((work / "spec.json").read_text(encoding="utf-8"))
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])

    from speculators.losses import resolve_loss_config
    from speculators.train.optimizers import build_optimizers
    from transformers import get_linear_schedule_with_warmup

    verifier = load_file(str(work / "verifier.safetensors"))
    model = build_drafter(spec["model"], spec["attn"], spec["ttt_steps"], verifier["d2t"], verifier["t2d"],
                          verifier["embed_tokens"], verifier["lm_head_rows"], spec["aux_layer_ids"], spec["verifier"])
    del verifier
    # our features store the verifier's final state after its norm (its data generation stores it before):
    # so its teacher here is verifier_lm_head(state), the verifier's logits, as on our side
    model.verifier_norm = torch.nn.Identity()
    model.train()
    loss_config = resolve_loss_config("kl_div", "eager")  # the fused loss is Triton, GPU only
    recipe = spec["recipe"]
    optimizers = build_optimizers(model, SimpleNamespace(
        optimizer=recipe["optimizer"], lr=recipe["lr"], weight_decay=0.01, muon_lr=recipe["lr"], muon_momentum=0.95,
        muon_weight_decay=0.1, muon_ns_steps=5, muon_adjust_lr_fn="match_rms_adamw"))
    files = sorted(work.glob("batch-*.safetensors"))
    total = len(files)
    warmup = int(total * recipe["warmup_ratio"]) if recipe["warmup_ratio"] is not None else total // 100
    schedulers = [get_linear_schedule_with_warmup(opt, warmup, total) for opt in optimizers]
    log = []
    for step, file in enumerate(files, 1):
        row = speculators_row(load_file(str(file)))
        _draft, loss, metrics = model(
            hidden_states=row["hidden_states"], input_ids=row["input_ids"], document_ids=row["document_ids"],
            loss_mask=row["loss_mask"], position_ids=row["position_ids"],
            verifier_last_hidden_states=row["verifier_last_hidden_states"], ttt_steps=spec["ttt_steps"],
            ttt_step_loss_decay=recipe["step_weight"], loss_config=loss_config,
        )
        if not torch.isfinite(loss):
            raise SystemExit(f"speculators: non-finite loss at step {step} ({file.name})")
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in optimizers:
            opt.step()
        for sched in schedulers:
            sched.step()
        acc0 = float(metrics["full_acc_0_sum"]) / max(float(metrics["full_acc_0_total"]), 1.0)
        log.append({"step": step, "loss": float(loss), "full_acc_0": acc0})
        if step % spec["log_every"] == 0 or step == total:
            print(f"speculators step {step}/{total}: loss {float(loss):.4f}, step-0 acc {acc0:.3f}", flush=True)
    model.save_pretrained(args.out)
    # its own proposals (draft ids, every TTT step) on the first batch: the driver checks that our reader
    # and our forward reproduce them from the saved checkpoint
    model.eval()
    with torch.no_grad():
        row = speculators_row(load_file(str(files[0])))
        drafts = model(hidden_states=row["hidden_states"], input_ids=row["input_ids"],
                       document_ids=row["document_ids"], position_ids=row["position_ids"], ttt_steps=spec["ttt_steps"])
    save_file({f"step_{i}": t[0].contiguous() for i, t in enumerate(drafts)},
              str(work / "speculators_drafts.safetensors"))
    (Path(args.out) / "speculators_training_log.json").write_text(json.dumps(log, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
