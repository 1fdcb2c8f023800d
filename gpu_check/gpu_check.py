"""One-GPU acceptance run: the real Eagle3Trainer's step at the recipes' drafter shapes, its memory against
`eagle3-hf plan`, its host synchronisations, bf16 against fp32, and a tiny extraction + speculative decoding run on
the device. Run through `gpu_check/gpu_check.sh`; writes one JSON ($OUT/gpu_check.json when $OUT is set).

1. Training step of two drafters on one 2048-token packed row (4 documents of 512), through `Eagle3Trainer`
   (`_get_num_items_in_batch`, `training_step`, clip 0.5, the Trainer's fused AdamW and scheduler), bf16 autocast
   as `--bf16` runs it, the row attention path (one call per TTT step), for each attention implementation
   (`sdpa`, `flex_attention`):
   - `llama31_8b`: hidden 4096, 32 x 128 heads, 8 KV heads, intermediate 14336, draft vocabulary 32 000 of
     128 256, TTT 7;
   - `kimi_k25`: hidden 7168, 56 x 128 heads, 8 KV heads, intermediate 18432, draft vocabulary 32 000 of
     163 840, TTT 3 (its recipe).
   Reports tokens/s, MFU = model FLOPs (`eagle3_hf.train.plan.train_flops_per_token`) / step time / the chip's
   dense bf16 peak, peak memory beside the plan's prediction, host synchronisations of one micro-step (the
   counter tests/train/test_host_syncs.py uses, and PyTorch's CUDA sync debug mode), and the loss of the same
   batch under bf16 autocast and in fp32.
2. Extraction + speculative decoding: a tiny learnable verifier on the device, its features captured and
   written with the project's shard writer, a tiny drafter trained on them for a few hundred steps, then
   speculative decoding checked token for token against the verifier's own greedy decoding (lossless).

`--device cpu --tiny` runs the same code at a tiny shape (CI). Exit status 0 only when every part passed (finite
losses, at most 2 host synchronisations per micro-step, bf16 within 2 % of fp32, lossless decoding).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

from eagle3_hf import Eagle3Config, Eagle3DraftModel  # noqa: E402
from eagle3_hf.train.loss import drafter_loss  # noqa: E402
from eagle3_hf.train.plan import (  # noqa: E402
    GIB,
    Launch,
    model_state_bytes,
    param_counts,
    step_peak_bytes,
    train_flops_per_token,
)

KIMI_TEXT_CONFIG = REPO / "examples/recipes/kimi_k25_text_config.json"
LLAMA_TEXT_CONFIG = REPO / "examples/recipes/llama31_8b_text_config.json"
MAX_SYNCS = 2  # per micro-step, as tests/train/test_host_syncs.py holds it on the CPU
BF16_LOSS_RTOL = 2e-2  # bf16 autocast against fp32, as tests/train/test_step_equivalence.py
TINY_TEXT_CONFIG = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 8, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 4096}
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}


def chip_peak_flops(device: str, override: float | None) -> tuple[float | None, str]:
    if override:
        return override * 1e12, "--peak-tflops"
    if device != "cuda":
        return None, "no bf16 peak on the CPU: MFU not reported"
    name = torch.cuda.get_device_name()
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops, f"{name}: dense bf16 {flops / 1e12:g} TFLOP/s"
    return None, f"{name}: unknown bf16 peak (pass --peak-tflops)"


class Memory:
    """Peak memory of a region: the CUDA allocator's statistics, or the process's resident set on the CPU."""

    def __init__(self, device: str):
        self.device = device

    def current(self) -> int:
        if self.device == "cuda":
            return torch.cuda.memory_allocated()
        return self._status("VmRSS")

    def reset_peak(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")

    def peak(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return self._status("VmHWM")

    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} missing from /proc/self/status")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- 1. training step


def packed_row(config: Eagle3Config, row_len: int, documents: int, device: str, seed: int = 0) -> dict:
    """One packed row of `documents` equal documents: random features, every position a loss position."""
    g = torch.Generator().manual_seed(seed)
    doc_len = row_len // documents
    document_ids = torch.arange(row_len).div(doc_len, rounding_mode="floor")[None]
    kept = torch.nonzero(torch.ones(config.vocab_size, dtype=torch.bool))[: config.draft_vocab_size, 0]
    row = {"input_ids": torch.randint(0, config.vocab_size, (1, row_len), generator=g),
           "aux_hidden_states": torch.randn(1, row_len, 3 * config.target_hidden_size, generator=g),
           "last_hidden_state": torch.randn(1, row_len, config.target_hidden_size, generator=g),
           "document_ids": document_ids, "position_ids": (torch.arange(row_len) % doc_len)[None],
           "loss_mask": torch.ones(1, row_len, dtype=torch.long),
           "verifier_greedy": kept[torch.randint(0, config.draft_vocab_size, (1, row_len), generator=g)]}
    return {k: v.to(device) for k, v in row.items()}


def make_train_step(model: Eagle3DraftModel, device: str, bf16: bool, steps: int = 3, lr: float = 1e-4):
    """The step `Eagle3Trainer` runs for the 1-GPU recipe: autocast forward + `drafter_loss` / loss tokens, backward,
    clip 0.5, fused AdamW, gradients dropped (set_to_none)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0, fused=True)

    def step(batch: dict) -> float:
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            step_loss = drafter_loss(model, batch, model.t2d, steps, model.config.ttt_step_weight)
            loss = step_loss.normalised()
        del step_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def trainer_for(model: Eagle3DraftModel, device: str, bf16: bool, steps: int, out_dir: Path):
    """The real Eagle3Trainer around `model`, as the recipes configure it: bf16 autocast on the accelerator, the
    row attention path (one call per TTT step), clip 0.5, the Trainer's default (fused) AdamW."""
    from eagle3_hf.train.arguments import Eagle3TrainingArguments
    from eagle3_hf.train.trainer import Eagle3Trainer

    args = Eagle3TrainingArguments(output_dir=str(out_dir), use_cpu=device == "cpu", bf16=bf16, ttt_steps=steps,
                                   packed_attention="row", max_grad_norm=0.5, learning_rate=1e-4, weight_decay=0.0,
                                   report_to="none", disable_tqdm=True, per_device_train_batch_size=1)
    return Eagle3Trainer(model=model, args=args)


def trainer_step(trainer, model, batch: dict) -> torch.Tensor:
    """One optimizer step as the Trainer's inner loop runs it: plans and loss tokens (get_batch_samples), the
    micro-step (`training_step`: forward, loss, metrics, backward), clip, optimizer and scheduler step."""
    batch = dict(batch)  # the Trainer leaves the batch's plan in it
    num_items = trainer._get_num_items_in_batch([batch], trainer.args.device)
    loss = trainer.training_step(model, batch, num_items)
    trainer.accelerator.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad(set_to_none=True)
    return loss


def count_host_syncs(trainer, model, batch: dict, device: str) -> dict:
    """One micro-step under the project's sync counter (eagle3_hf.train.host_sync, as tests/train/test_host_syncs.py
    counts it on the CPU) and, on CUDA, under PyTorch's sync debug mode (every synchronising call warns)."""
    import warnings

    from eagle3_hf.train.host_sync import HostSyncCounter

    batch = dict(batch)
    num_items = trainer._get_num_items_in_batch([batch], trainer.args.device)  # once per optimizer step
    sync(device)
    with warnings.catch_warnings(record=True) as caught, HostSyncCounter() as syncs:
        warnings.simplefilter("always")
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.training_step(model, batch, num_items)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    model.zero_grad(set_to_none=True)
    cuda_syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return {"host_syncs_per_micro_step": syncs.total, "host_sync_ops": dict(syncs.ops),
            "cuda_sync_warnings": len(cuda_syncs) if device == "cuda" else None, "cuda_sync_first": cuda_syncs[:3]}


def bf16_agreement(trainer, model, batch: dict, device: str) -> dict:
    """The same batch's loss under bf16 autocast and in fp32, same weights (before any step)."""
    batch = dict(batch)
    num_items = trainer._get_num_items_in_batch([batch], trainer.args.device)
    model.eval()
    with torch.no_grad():
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss16 = float(trainer.compute_loss(model, dict(batch), num_items_in_batch=num_items))
        loss32 = float(trainer.compute_loss(model, dict(batch), num_items_in_batch=num_items))
    model.train()
    return {"loss_bf16": loss16, "loss_fp32": loss32, "bf16_vs_fp32_loss_rel": abs(loss16 - loss32) / abs(loss32)}


def train_step_check(name: str, config: Eagle3Config, attn: str, device: str, bf16: bool, row_len: int,
                     documents: int, ttt_steps: int, timed_steps: int, peak_flops: float | None, out_dir: Path) -> dict:
    torch.manual_seed(0)
    config._attn_implementation = attn
    with torch.device(device):
        model = Eagle3DraftModel(config)
        vocab, target = config.vocab_size, config.target_hidden_size
        model.load_verifier_embeddings(torch.randn(vocab, config.hidden_size) * 0.02)
        model.attach_teacher(torch.randn(vocab, target) * 0.02)  # rows of the draft vocabulary are kept
    model.train()
    trainer = trainer_for(model, device, bf16, ttt_steps, out_dir)
    batch = packed_row(config, row_len, documents, device)
    agreement = bf16_agreement(trainer, model, batch, device)
    trainer.create_optimizer_and_scheduler(num_training_steps=1000)
    model = trainer.accelerator.prepare_model(model)  # as train() does: autocast around forward under --bf16
    memory = Memory(device)
    t0 = time.perf_counter()
    first_loss = float(trainer_step(trainer, model, batch))  # warm-up: AdamW state, kernels, flex compilation
    sync(device)
    warmup_s = time.perf_counter() - t0
    syncs = count_host_syncs(trainer, model, batch, device)
    before = memory.current()
    memory.reset_peak()
    times, losses = [], []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        losses.append(trainer_step(trainer, model, batch))
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = memory.peak()
    loss_values = [first_loss, *(float(x) for x in losses)]
    step_s = statistics.median(times)
    params = param_counts(config)
    flops = row_len * train_flops_per_token(config, ttt_steps, row_len / documents)
    states = model_state_bytes(params, Launch())["gpu"]
    dtype = "bf16" if bf16 else "fp32"
    autocast = params["trained"] if bf16 else 0
    step_pred = step_peak_bytes(config, row_len, ttt_steps, 4 * params["trained"], dtype, autocast_params=autocast)
    measured_step = peak - before
    result = {
        "shape": name, "attn_implementation": attn, "dtype": dtype, "tokens": row_len, "documents": documents,
        "ttt_steps": ttt_steps, "hidden_size": config.hidden_size, "warmup_s": warmup_s, "step_s": times,
        "tokens_per_s": row_len / step_s, "model_tflop_per_step": flops / 1e12, "losses": loss_values,
        "loss_finite": all(x == x and abs(x) != float("inf") for x in loss_values),
        "peak_memory_gib": peak / GIB, "step_memory_gib": measured_step / GIB,
        "plan_step_peak_gib": step_pred / GIB, "step_memory_measured_over_plan": measured_step / step_pred,
        **syncs, **agreement,
    }
    if device == "cuda":  # the allocator's peak is absolute: compare it with the plan's per-GPU total
        plan_total = states + step_peak_bytes(config, row_len, ttt_steps, 0, dtype, autocast_params=autocast)
        result.update(plan_total_gib=plan_total / GIB, peak_measured_over_plan_total=peak / plan_total)
    if peak_flops:
        result["mfu"] = flops / step_s / peak_flops
    del model, trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


# ---------------------------------------------------------------------------------------------- 2. extraction + spec


def learnable_verifier(device: str, vocab: int = 256, hidden: int = 64, layers: int = 6):
    """A tiny Llama whose greedy next token is mostly (token + 1): a drafter learns it in a few hundred steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.copy_(torch.roll(model.model.embed_tokens.weight, shifts=1, dims=0))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
    return model.to(device).eval().requires_grad_(False)


def extraction_and_speculative(device: str, out_dir: Path, train_steps: int) -> dict:
    from eagle3_hf.data.vocab import vocab_from_target_ids
    from eagle3_hf.decoding import compare_to_greedy, greedy_generate, speculative_decode
    from eagle3_hf.features.extract import verifier_info
    from eagle3_hf.features.packing import PackedCollator, PackedDataset
    from eagle3_hf.features.reader import FeatureDataset
    from eagle3_hf.features.records import make_header
    from eagle3_hf.features.store import ShardWriter, merge_manifests
    from eagle3_hf.verifier.capture import capture_features

    verifier = learnable_verifier(device)
    aux = [1, 3, 4]
    g = torch.Generator().manual_seed(1)
    samples = [torch.arange(2, 200, 2)[torch.randint(0, 99, (int(torch.randint(24, 64, (1,), generator=g)),),
                                                      generator=g)] for _ in range(48)]
    t0 = time.perf_counter()
    writer = ShardWriter(out_dir, make_header(verifier_info(verifier, "tiny-learnable"), "tiny", aux, "bfloat16"))
    tokens = 0
    for i, ids in enumerate(samples):
        feats = capture_features(verifier, ids, aux, out_device="cpu")
        mask = torch.ones_like(ids)
        mask[:4] = 0
        writer.add(f"s{i:03d}", ids, mask, feats["aux_hidden_states"], feats["last_hidden_state"],
                   feats["verifier_greedy"])
        tokens += ids.numel()
    writer.close()
    merge_manifests(out_dir)
    extract_s = time.perf_counter() - t0

    features = FeatureDataset(out_dir, split="all")
    greedy = torch.cat([features[i]["verifier_greedy"] for i in range(len(features))])
    d2t, t2d = vocab_from_target_ids(torch.unique(greedy), verifier.config.vocab_size)
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=d2t.numel(), aux_hidden_state_indices=aux)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    drafter = Eagle3DraftModel(config)
    drafter.set_vocab_mapping(d2t, t2d)
    drafter.load_verifier_embeddings(verifier.cpu())
    drafter.attach_teacher(verifier)
    verifier.to(device)
    drafter.to(device).train()
    step = make_train_step(drafter, device, bf16=False, lr=3e-3)
    packed = PackedDataset(features, 256, seed=None)
    collate = PackedCollator(max_seq_len=256)
    rows = [{k: v.to(device) for k, v in collate([packed[r]]).items()} for r in range(len(packed))]
    t0 = time.perf_counter()
    losses = [step(rows[s % len(rows)]) for s in range(train_steps)]
    train_s = time.perf_counter() - t0
    drafter.eval()

    results, accepted, forwards = [], 0, 0
    for p in range(4):
        prompt = samples[p][:8].tolist()
        ref = greedy_generate(verifier, prompt, max_new_tokens=32)
        spec = speculative_decode(verifier, drafter, prompt, steps=3, max_new_tokens=32)
        verdict, where = compare_to_greedy(spec.tokens, spec.margins, ref.tokens, ref.margins)
        results.append(verdict)
        accepted += len(spec.tokens)
        forwards += spec.num_verifier_forwards + 1
    return {"samples": len(samples), "tokens": tokens, "extract_s": extract_s, "feature_dtype": "bfloat16",
            "drafter_train_steps": train_steps, "train_s": train_s, "first_loss": losses[0], "last_loss": losses[-1],
            "lossless": results, "lossless_ok": all(r != "mismatch" for r in results),
            "tokens_per_verifier_forward": accepted / max(forwards, 1)}


# ---------------------------------------------------------------------------------------------- driver


def shapes(tiny: bool) -> list[tuple[str, Eagle3Config, int]]:
    """(name, drafter config, TTT steps) of the acceptance run: the Llama-3.1-8B drafter at 7 TTT steps and the
    Kimi-K2.5 drafter at its recipe's 3; `--tiny`: one tiny drafter at 3 (CI)."""
    if tiny:
        return [("tiny", Eagle3Config.from_verifier(TINY_TEXT_CONFIG, draft_vocab_size=256, ttt_steps=3), 3)]
    out = []
    for name, path, steps in (("llama31_8b", LLAMA_TEXT_CONFIG, 7), ("kimi_k25", KIMI_TEXT_CONFIG, 3)):
        config = Eagle3Config.from_verifier(json.loads(path.read_text()), draft_vocab_size=32000, ttt_steps=steps)
        out.append((name, config, steps))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the same code in seconds (CI)")
    parser.add_argument("--attn", default=None,
                        help="attention implementations to time (default: sdpa,flex_attention on CUDA; sdpa on CPU)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per implementation")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the chip's dense bf16 peak (default: by name)")
    parser.add_argument("--out", default=None,
                        help="the report (default: $OUT/gpu_check.json when $OUT is set, else gpu_check.json)")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(Path(os.environ["OUT"]) / "gpu_check.json") if os.environ.get("OUT") else "gpu_check.json"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible (use --device cpu --tiny for the CPU path)")
    started = time.perf_counter()
    row_len, documents = (256, 4) if args.tiny else (2048, 4)
    bf16 = args.device == "cuda"
    peak_flops, peak_note = chip_peak_flops(args.device, args.peak_tflops)
    report: dict = {"device": args.device, "tiny": args.tiny, "torch": torch.__version__,
                    "python": platform.python_version(),
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "peak": peak_note,
                    "drafters": {name: {"hidden_size": c.hidden_size, "heads": c.num_attention_heads,
                                        "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                                        "intermediate_size": c.intermediate_size, "ttt_steps": steps,
                                        "draft_vocab_size": c.draft_vocab_size, "vocab_size": c.vocab_size}
                                 for name, c, steps in shapes(args.tiny)},
                    "train_step": [], "errors": [], "notes": []}
    attns = [a.strip() for a in (args.attn or ("sdpa,flex_attention" if bf16 else "sdpa")).split(",") if a.strip()]
    if args.device == "cpu" and "flex_attention" in attns:  # PyTorch: "FlexAttention does not support backward on CPU"
        attns.remove("flex_attention")
        report["notes"].append("flex_attention skipped: PyTorch has no flex_attention backward on the CPU")
    import transformers

    report["transformers"] = transformers.__version__
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part, so a run cut short still leaves what it measured
        Path(args.out).write_text(json.dumps(report, indent=1), encoding="utf-8")

    print(f"{'shape':10s} {'attention':15s} {'tok/s':>9s} {'step s':>7s} {'MFU':>6s} {'peak GiB':>8s} {'plan GiB':>8s} "
          f"{'syncs':>5s} {'cuda':>4s} {'bf16/fp32 loss':>14s}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_trainer_") as trainer_dir:
        for name, config, ttt_steps in shapes(args.tiny):
            for attn in attns:
                try:
                    row = train_step_check(name, config, attn, args.device, bf16, row_len, documents, ttt_steps,
                                           args.steps, peak_flops, Path(trainer_dir))
                except Exception as err:  # noqa: BLE001 - one implementation failing must not hide the others
                    report["errors"].append(f"train_step {name} {attn}: {type(err).__name__}: {err}")
                    traceback.print_exc()
                    continue
                report["train_step"].append(row)
                save()
                plan_gib = row.get("plan_total_gib", row["plan_step_peak_gib"])
                peak_gib = row["peak_memory_gib"] if "plan_total_gib" in row else row["step_memory_gib"]
                print(f"{name:10s} {attn:15s} {row['tokens_per_s']:9.0f} {statistics.median(row['step_s']):7.3f} "
                      f"{row.get('mfu', float('nan')):6.1%} {peak_gib:8.2f} {plan_gib:8.2f} "
                      f"{row['host_syncs_per_micro_step']:5d} {row['cuda_sync_warnings'] or 0:4d} "
                      f"{row['bf16_vs_fp32_loss_rel']:14.2e}", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
            report["extract_speculative"] = extraction_and_speculative(args.device, Path(tmp) / "features",
                                                                       train_steps=60 if args.tiny else 300)
        es = report["extract_speculative"]
        print(f"extraction {es['tokens']} tokens in {es['extract_s']:.1f} s; drafter loss {es['first_loss']:.2f} -> "
              f"{es['last_loss']:.2f}; lossless {es['lossless']}; {es['tokens_per_verifier_forward']:.2f} "
              "tokens per verifier forward", flush=True)
    except Exception as err:  # noqa: BLE001
        report["errors"].append(f"extract_speculative: {type(err).__name__}: {err}")
        traceback.print_exc()
    report["seconds"] = time.perf_counter() - started
    report["ok"] = (not report["errors"] and all(r["loss_finite"] for r in report["train_step"])
                    and all(r["host_syncs_per_micro_step"] <= MAX_SYNCS for r in report["train_step"])
                    and all(r["bf16_vs_fp32_loss_rel"] < BF16_LOSS_RTOL for r in report["train_step"])
                    and report.get("extract_speculative", {}).get("lossless_ok", False))
    save()
    print(f"{'OK' if report['ok'] else 'FAILED'} in {report['seconds']:.0f} s -> {args.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
