"""gpu_check's first part: the real Eagle3Trainer's step at a drafter shape, its speed (tokens/s, MFU against the
chip's bf16 peak), its memory against `eagle3-hf plan`, and its host synchronisations."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.train.loss import drafter_loss
from eagle3_hf.train.plan import GIB, model_state_bytes
from eagle3_hf.train.plan_drafter import Eagle3Arithmetic
from eagle3_hf.train.plan_inputs import Launch

MAX_SYNCS = 2  # per micro-step, as tests/train/test_host_syncs.py holds it on the CPU
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


def trainer_for(model: Eagle3DraftModel, device: str, bf16: bool, steps: int, out_dir: Path, lr: float = 1e-4):
    """The real Eagle3Trainer around `model`, as the recipes configure it: bf16 autocast on the accelerator, the
    row attention path (one call per TTT step), clip 0.5, the Trainer's default (fused) AdamW."""
    from eagle3_hf.train.arguments import Eagle3TrainingArguments
    from eagle3_hf.train.trainer import Eagle3Trainer

    args = Eagle3TrainingArguments(output_dir=str(out_dir), use_cpu=device == "cpu", bf16=bf16, ttt_steps=steps,
                                   packed_attention="row", max_grad_norm=0.5, learning_rate=lr, weight_decay=0.0,
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


def new_drafter(config: Eagle3Config, device: str, seed: int = 0) -> Eagle3DraftModel:
    """A drafter at `config` on `device`, seeded: random weights, verifier embedding and teacher rows."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Eagle3DraftModel(config)
        vocab, target = config.vocab_size, config.target_hidden_size
        model.load_verifier_embeddings(torch.randn(vocab, config.hidden_size) * 0.02)
        model.attach_teacher(torch.randn(vocab, target) * 0.02)  # rows of the draft vocabulary are kept
    return model.train()


def train_step_check(name: str, config: Eagle3Config, attn: str, device: str, bf16: bool, row_len: int,
                     documents: int, ttt_steps: int, timed_steps: int, peak_flops: float | None, out_dir: Path) -> dict:
    config._attn_implementation = attn
    model = new_drafter(config, device)
    trainer = trainer_for(model, device, bf16, ttt_steps, out_dir)
    batch = packed_row(config, row_len, documents, device)
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
    arithmetic = Eagle3Arithmetic(config, ttt_steps)
    params = arithmetic.params()
    flops = row_len * arithmetic.train_flops_per_token(row_len / documents)
    states = model_state_bytes(params, Launch()).gpu
    dtype = "bf16" if bf16 else "fp32"
    autocast = params.trained if bf16 else 0
    step_pred = arithmetic.step_peak_bytes(row_len, 4 * params.trained, dtype, autocast_params=autocast)
    measured_step = peak - before
    result = {
        "shape": name, "attn_implementation": attn, "dtype": dtype, "tokens": row_len, "documents": documents,
        "ttt_steps": ttt_steps, "hidden_size": config.hidden_size, "warmup_s": warmup_s, "step_s": times,
        "tokens_per_s": row_len / step_s, "model_tflop_per_step": flops / 1e12, "losses": loss_values,
        "loss_finite": all(x == x and abs(x) != float("inf") for x in loss_values),
        "peak_memory_gib": peak / GIB, "step_memory_gib": measured_step / GIB,
        "plan_step_peak_gib": step_pred / GIB, "step_memory_measured_over_plan": measured_step / step_pred,
        **syncs,
    }
    if device == "cuda":  # the allocator's peak is absolute: compare it with the plan's per-GPU total
        plan_total = states + arithmetic.step_peak_bytes(row_len, 0, dtype, autocast_params=autocast)
        result.update(plan_total_gib=plan_total / GIB, peak_measured_over_plan_total=peak / plan_total)
    if peak_flops:
        result["mfu"] = flops / step_s / peak_flops
    del model, trainer
    if device == "cuda":
        torch.cuda.empty_cache()
    return result
