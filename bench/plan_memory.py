"""Validate `eagle3-hf plan`'s activation model: predicted vs measured peak memory of a real drafter step on CPU.

Each shape runs in a fresh subprocess (fp32, 1 thread, glibc's mmap threshold fixed so that freed tensors leave
the resident set): build `Eagle3DraftModel`, run one warm-up step (AdamW state exists afterwards), drop the
gradients, then measure one training step as `Eagle3Trainer` runs it (TTT forward, `drafter_loss`, backward, clip,
AdamW). Measured = the process's resident high-water mark during the step minus its resident size just before
(so parameters and optimizer state are excluded: they are resident before the step). Predicted = the plan's
step peak for the same shape: activations and logits of the unroll plus the parameter gradients.

DFlash shapes (`dflash-*`) run `DFlashDraftModel` and `dflash_loss` the same way against `DFlashArithmetic`;
`--bf16` runs them under CPU bf16 autocast (bf16 features, fp32 weights, as the Trainer's `--bf16`) against the
plan's bf16 peak with autocast's weight copies.

    python -m bench.plan_memory            # the three shapes of docs/results/plan.md, ~1 min
    python -m bench.plan_memory --shapes dflash-h256-V32k,dflash-h512-V8k [--bf16]
    python -m bench.plan_memory --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (hidden, heads, kv heads, head_dim, intermediate, verifier vocab, draft vocab, row length, documents per row)
SHAPES = {
    "h256-L2048": (256, 4, 2, 64, 768, 8192, 2048, 2048, 4),
    "h512-L1024": (512, 4, 4, 128, 1408, 16384, 8192, 1024, 2),
    "h1024-L1024": (1024, 8, 8, 128, 2816, 32768, 16000, 1024, 3),
}
# DFlash: (hidden, heads, kv heads, head_dim, intermediate, vocabulary, layers, block size, anchors per row, row
# length, documents per row); the full-vocabulary logits dominate the first, the block's layers weigh more in the second
DFLASH_SHAPES = {
    "dflash-h256-V32k": (256, 4, 2, 64, 768, 32768, 2, 16, 32, 1024, 2),
    "dflash-h512-V8k": (512, 8, 8, 64, 1408, 8192, 3, 8, 64, 1024, 2),
}


def _rss(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(shape: tuple, ttt_steps: int = 3) -> dict:
    """One step of the drafter at `shape` in this process; returns bytes (see the module docstring)."""
    import torch

    from eagle3_hf import Eagle3Config, Eagle3DraftModel
    from eagle3_hf.train.loss import count_loss_tokens, drafter_loss

    hidden, heads, kv_heads, head_dim, inter, vocab, draft, length, docs = shape
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Eagle3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=8192,
                          draft_vocab_size=draft, target_hidden_size=hidden, aux_hidden_state_indices=[1, 2, 3])
    config._attn_implementation = "sdpa"
    model = Eagle3DraftModel(config)
    kept = torch.randperm(vocab)[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    model.set_vocab_mapping(kept - torch.arange(draft), t2d)
    model.attach_teacher(torch.randn(vocab, hidden) * 0.02)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    doc_len = length // docs
    document_ids = torch.arange(length).div(doc_len, rounding_mode="floor").clamp(max=docs - 1)[None]
    position_ids = (torch.arange(length) - document_ids[0] * doc_len)[None]
    batch = {"input_ids": torch.randint(0, vocab, (1, length)), "aux_hidden_states": torch.randn(1, length, 3 * hidden),
             "last_hidden_state": torch.randn(1, length, hidden), "document_ids": document_ids,
             "position_ids": position_ids, "loss_mask": (position_ids >= doc_len // 4).long(),
             "verifier_greedy": kept[torch.randint(0, draft, (1, length))]}  # every target in the draft vocabulary

    def loss_of(b: dict):  # Eagle3Trainer.compute_loss's loss, with the default step weight
        step = drafter_loss(model, b, model.t2d, ttt_steps, config.ttt_step_weight)
        return step.normalised()

    def step(b: dict) -> None:
        loss_of(b).backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step({k: v[:, :64] for k, v in batch.items()})  # warm-up: AdamW state, first-call allocations
    loss_tokens = int(count_loss_tokens(batch, t2d))
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM
    before = _rss("VmRSS")
    step(batch)
    return {"measured_bytes": _rss("VmHWM") - before, "tokens": length, "loss_tokens": loss_tokens,
            "trainable_params": sum(p.numel() for p in trainable)}


def _packed_batch(vocab: int, hidden: int, length: int, docs: int) -> dict:
    import torch

    doc_len = length // docs
    document_ids = torch.arange(length).div(doc_len, rounding_mode="floor").clamp(max=docs - 1)[None]
    position_ids = (torch.arange(length) - document_ids[0] * doc_len)[None]
    return {"input_ids": torch.randint(0, vocab, (1, length)), "aux_hidden_states": torch.randn(1, length, 3 * hidden),
            "last_hidden_state": torch.randn(1, length, hidden), "document_ids": document_ids,
            "position_ids": position_ids, "loss_mask": (position_ids >= doc_len // 4).long(),
            "verifier_greedy": torch.randint(0, vocab, (1, length))}


def _dflash_config(shape: tuple):
    from eagle3_hf.model.configuration_dflash import DFlashConfig

    hidden, heads, kv_heads, head_dim, inter, vocab, layers, block, _, _, _ = shape
    verifier = {"hidden_size": hidden, "num_hidden_layers": 4, "num_attention_heads": heads,
                "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": inter, "vocab_size": vocab,
                "max_position_embeddings": 8192}
    config = DFlashConfig.from_verifier(verifier, mask_token_id=vocab - 1, num_hidden_layers=layers, block_size=block)
    config._attn_implementation = "sdpa"
    return config


def measure_dflash(shape: tuple, bf16: bool = False) -> dict:
    """One DFlash training step at `shape` in this process, as `measure` does for EAGLE-3."""
    import torch

    from eagle3_hf.model.modeling_dflash import DFlashDraftModel
    from eagle3_hf.train.dflash_loss import ANCHORS_KEY, dflash_loss, sample_anchors

    hidden, _, _, _, _, vocab, _, _, anchors, length, docs = shape
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DFlashDraftModel(_dflash_config(shape))
    model.load_verifier_weights(torch.randn(vocab, hidden) * 0.02, torch.randn(vocab, hidden) * 0.02)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    batch = _packed_batch(vocab - 1, hidden, length, docs)  # the mask token never occurs
    if bf16:
        batch["aux_hidden_states"], batch["last_hidden_state"] = (batch[k].bfloat16() for k in
                                                                  ("aux_hidden_states", "last_hidden_state"))

    def step(b: dict) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = dflash_loss(model, b, anchors).normalised()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step({k: v[:, :128] for k, v in batch.items()})  # warm-up: AdamW state, first-call allocations
    batch[ANCHORS_KEY] = sample_anchors(batch, anchors)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM
    before = _rss("VmRSS")
    step(batch)
    return {"measured_bytes": _rss("VmHWM") - before, "tokens": length,
            "anchors": int((batch[ANCHORS_KEY] >= 0).sum()), "trainable_params": sum(p.numel() for p in trainable)}


def predicted_dflash(shape: tuple, measured: dict, bf16: bool = False) -> int:
    from eagle3_hf.train.plan_drafter import DFlashArithmetic

    anchors, length = shape[8], shape[9]
    arithmetic = DFlashArithmetic(_dflash_config(shape), anchors, length)
    trained = measured["trainable_params"]
    return arithmetic.step_peak_bytes(length, grad_bytes=4 * trained, dtype="bf16" if bf16 else "fp32",
                                      loss_fraction=measured["anchors"] / arithmetic.anchors,
                                      autocast_params=trained if bf16 else 0)


def predicted(shape: tuple, measured: dict, ttt_steps: int = 3) -> int:
    from eagle3_hf.model.configuration_eagle3 import Eagle3Config
    from eagle3_hf.train.plan_drafter import Eagle3Arithmetic

    hidden, heads, kv_heads, head_dim, inter, vocab, draft, length, docs = shape
    config = Eagle3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, head_dim=head_dim, draft_vocab_size=draft,
                          target_hidden_size=hidden)
    return Eagle3Arithmetic(config, ttt_steps).step_peak_bytes(length, grad_bytes=4 * measured["trainable_params"],
                                                               dtype="fp32",
                                                               loss_fraction=measured["loss_tokens"] / length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, from {list(SHAPES) + list(DFLASH_SHAPES)}")
    parser.add_argument("--json", default=None)
    parser.add_argument("--bf16", action="store_true", help="DFlash shapes under bf16 autocast")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure_dflash(DFLASH_SHAPES[args.worker], args.bf16) if args.worker in DFLASH_SHAPES
                         else measure(SHAPES[args.worker])))
        return
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               TRANSFORMERS_VERBOSITY="error")
    rows = []
    print(f"{'shape':16s} {'tokens':>6s} {'predicted MiB':>13s} {'measured MiB':>12s} {'pred/meas':>9s}")
    for name in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        if args.bf16 and name not in DFLASH_SHAPES:
            raise SystemExit(f"{name}: --bf16 is for the DFlash shapes")
        proc = subprocess.run([sys.executable, __file__, "--worker", name, *(["--bf16"] if args.bf16 else [])],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            raise SystemExit(f"{name}: worker failed\n{proc.stderr[-3000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        pred = (predicted_dflash(DFLASH_SHAPES[name], got, args.bf16) if name in DFLASH_SHAPES
                else predicted(SHAPES[name], got))
        row = {"shape": name, **got, "predicted_bytes": pred, "ratio": pred / got["measured_bytes"]}
        rows.append(row)
        print(f"{name:16s} {got['tokens']:6d} {pred / 2**20:13.0f} {got['measured_bytes'] / 2**20:12.0f} "
              f"{row['ratio']:9.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
