"""`eagle3-hf plan`: what a training run needs — GPU memory, feature disk, FLOPs and time — before it runs.

Inputs are the files the run itself uses: the recipe (`examples/recipes/*.yaml`, the YAML `--config` gives the
training script) and the accelerate config (`accelerate_configs/*.yaml`: number of processes and machines, and
through its DeepSpeed file the ZeRO stage and offload). The verifier's sizes come from its config
(`--verifier-config FILE` where the Hub cannot be reached). Per GPU memory is

- model states: parameters, gradients and AdamW states. With DeepSpeed, DeepSpeed's own estimators
  (`estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`) for the trained parameters,
  plus the frozen ones (verifier embedding and teacher rows) in bf16, partitioned under ZeRO-3. Without
  DeepSpeed the Trainer keeps fp32 weights under bf16 autocast: 4 + 4 + 8 bytes per trained parameter and 4
  per frozen one;
- the training step's peak above that (`step_peak_bytes`): the TTT unroll's saved activations, every step's
  logits and the teacher's probabilities (at the positions the loss reads), plus what the largest of three
  moments adds: the end of the loss forward, the loss's backward, the last TTT step's layer backward.
  Validated against measured peaks by `bench/plan_memory.py` (docs/results/plan.md).

The drafter's own numbers (parameters, the step peak, FLOPs per token, the features it reads) come from the
recipe's `drafter_kind` (plan_drafter.py); the inputs travel as records (plan_inputs.py: `Launch`, `Hardware`,
`ExtractionInputs`) and the plan is one (`Plan`, written by `--json` as `plan_json`).

Time is the longer of the training's compute and its feature reads (plan_disk.py); the extraction engine spans the
GPUs that hold the verifier's weights (verifier/footprint.py), and a verifier no engine of a node can hold is a
DOES NOT FIT verdict.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..verifier.footprint import footprint, verifier_params
from .plan_disk import ExtractionBudget, TrainingReads, extraction_budget, stored_dtype, training_reads
from .plan_drafter import DrafterArithmetic, DrafterRecord, ParamCounts, drafter_arithmetic, feature_bytes_per_token
from .plan_inputs import (
    ExtractionInputs,
    Hardware,
    Launch,
    dataset_from_features,
    draft_vocab_from_features,
    load_yaml_or_json,
    read_launch,
    verifier_text_config,
    verifier_weights,
)
from .plan_reader import READER_GBPS, EngineSize, ReaderPlan, engine_size, node_prefill_tokens_per_s, reader_plan
from .shm import ShmNeed, feature_dtype, shm_plan, shm_plan_line

__all__ = ["GIB", "Plan", "build_plan", "feature_bytes_per_token", "format_plan", "plan_json", "verifier_params"]

GIB = 2**30


# ---------------------------------------------------------------------------------------------- model states


@dataclass(frozen=True)
class ModelStates:
    """Parameters, gradients and AdamW states (`model_state_bytes`)."""

    gpu: float  # bytes per GPU
    cpu: float  # bytes per node, with offload
    rule: str  # how they were estimated


def model_state_bytes(params: ParamCounts, launch: Launch) -> ModelStates:
    """Per-GPU (and, with offload, per-node CPU) bytes of parameters, gradients and AdamW states."""
    trained, frozen = params.trained, params.frozen
    gpus, nodes = launch.num_processes, launch.num_machines
    per_node = max(1, gpus // nodes)
    if launch.zero_stage == 0:
        return ModelStates(16 * trained + 4 * frozen, 0, "fp32 weights, gradients, AdamW states")
    if launch.zero_stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(trained, per_node, nodes, launch.offload_optimizer)
        if launch.zero_stage == 1:  # stage 1 keeps the full 16-bit gradients on every GPU
            gpu += 2 * trained * (1 - 1 / gpus)
        return ModelStates(gpu + 2 * frozen, cpu,
                           f"DeepSpeed estimate_zero2_model_states_mem_needs (stage {launch.zero_stage}) + bf16 frozen")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        trained, params.largest_layer, per_node, nodes, launch.offload_optimizer, launch.offload_param,
        launch.zero_init)
    frozen_gpu = 0 if launch.offload_param else 2 * frozen / gpus
    return ModelStates(gpu + frozen_gpu, cpu,
                       "DeepSpeed estimate_zero3_model_states_mem_needs + bf16 frozen, partitioned")


def ddp_bucket_bytes(params: ParamCounts, launch: Launch) -> int:
    """DDP's gradient buckets: without ZeRO and with more than one process, the reducer holds a flat fp32 copy
    of every trained gradient (transformers leaves `gradient_as_bucket_view` off), on top of the gradients."""
    return 4 * params.trained if launch.zero_stage == 0 and launch.num_processes > 1 else 0


# ---------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Memory:
    """Per-GPU bytes of the run against the GPU's memory."""

    model_states: float
    model_states_rule: str
    cpu_offload: float  # per node
    step_peak: int
    ddp_buckets: int
    total: float
    gpu_memory_gib: float
    reserve_gib: float
    fits: bool


@dataclass(frozen=True)
class VerifierSummary:
    """The verifier's sizes and the extraction engine that holds its weights."""

    layers: int
    hidden_size: int
    vocab_size: int
    params: dict[str, float]  # verifier_params: total, active
    weights_bytes: float
    weights: str
    engine: EngineSize



@dataclass(frozen=True)
class DataPlan:
    """Disk, FLOPs and time for a dataset of `tokens`: the extraction's, the training's, and what bounds the run."""

    tokens: float
    mean_document_tokens: float
    disk_bf16: float
    disk_fp8: float
    extract_flops: float
    extract_gpu_hours: float
    extract_hours: float
    extract_gpus: int
    epoch_flops: float
    epoch_hours: float
    epochs: float
    mfu: float
    peak_tflops: float
    features_dtype: str
    reads: TrainingReads
    read_tokens_per_s_per_node: float  # what the loader must deliver for the GPUs never to wait
    read_bytes_per_s_per_node: float



@dataclass
class Plan:
    """Everything `eagle3-hf plan` prints (`plan_json`: what `--json` writes)."""

    drafter: DrafterRecord
    launch: Launch
    micro_batch_tokens: int
    dtype: str
    memory: Memory
    shm: ShmNeed
    reader: ReaderPlan
    verifier: VerifierSummary
    step_peak_holds: str  # what the drafter's step peak is made of (printed, not written)
    notes: list[str] = field(default_factory=list)
    zero3_gathered_per_micro_step: int | None = None
    extraction: ExtractionBudget | None = None
    data: DataPlan | None = None

    @property
    def fits(self) -> bool:
        return self.memory.fits and not self.verifier.engine.problem



def plan_json(plan: Plan) -> dict[str, Any]:
    """What `--json` writes: the plan's records, the drafter's, verifier's and data's nested ones flattened into
    their parents (the file's keys are those scripts and bench/ read)."""
    d, v = plan.drafter, plan.verifier
    out: dict[str, Any] = {
        "drafter": {**{k: x for k, x in vars(d).items() if k != "params"},
                    **{f"params_{k}": x for k, x in vars(d.params).items()}},
        "launch": vars(plan.launch), "micro_batch_tokens": plan.micro_batch_tokens, "dtype": plan.dtype,
        "memory": asdict(plan.memory), "notes": plan.notes}
    if plan.zero3_gathered_per_micro_step is not None:
        out["zero3_gathered_per_micro_step"] = plan.zero3_gathered_per_micro_step
    out |= {"shm": {**asdict(plan.shm), "bytes": plan.shm.bytes}, "reader": asdict(plan.reader),
            "verifier": {"layers": v.layers, "hidden_size": v.hidden_size, "vocab_size": v.vocab_size,
                         **{f"params_{k}": x for k, x in v.params.items()}, "weights_bytes": v.weights_bytes,
                         "weights": v.weights, **asdict(v.engine)}}
    if plan.extraction is not None:
        out["extraction"] = asdict(plan.extraction)
    if plan.data is not None:  # the training reads' fields in place of their record
        out["data"] = {}
        for f in fields(plan.data):
            value = getattr(plan.data, f.name)
            out["data"] |= asdict(value) if f.name == "reads" else {f.name: value}
    return out


def _memory(drafter: DrafterArithmetic, params: ParamCounts, launch: Launch, micro_tokens: int, dtype: str,
            hardware: Hardware) -> Memory:
    states = model_state_bytes(params, launch)
    autocast = params.trained if dtype == "bf16" and launch.zero_stage == 0 else 0  # DeepSpeed: bf16 weights
    step = drafter.step_peak_bytes(micro_tokens, 0, dtype, autocast_params=autocast)  # grads: in the states
    buckets = ddp_bucket_bytes(params, launch)
    total = states.gpu + step + buckets
    return Memory(model_states=states.gpu, model_states_rule=states.rule, cpu_offload=states.cpu, step_peak=step,
                  ddp_buckets=buckets, total=total, gpu_memory_gib=hardware.gpu_memory_gib,
                  reserve_gib=hardware.reserve_gib,
                  fits=total <= (hardware.gpu_memory_gib - hardware.reserve_gib) * GIB)


def _notes(recipe: dict[str, Any], drafter: DrafterArithmetic, params: ParamCounts, memory: Memory,
           launch: Launch, hardware: Hardware) -> tuple[list[str], int | None]:
    """The plan's notes, and under ZeRO-3 the bytes it gathers per micro-batch."""
    notes, gathered = [], None
    if launch.zero_stage == 3:
        gathered = drafter.zero3_gathered_bytes()
        ddp = 16 * params.trained + 4 * params.frozen + memory.step_peak + 4 * params.trained
        notes.append(f"ZeRO-3 all-gathers {gathered / GIB:.1f} GiB of bf16 weights per micro-batch "
                     f"({drafter.zero3_gathers}); "
                     + ("DDP needs no gather: prefer it, the drafter fits one GPU" if
                        ddp <= (hardware.gpu_memory_gib - hardware.reserve_gib) * GIB
                        else "the drafter does not fit one GPU with DDP"))
    if recipe.get("hidden_optimizer", "adamw") != "adamw":
        notes.append(f"model states assume AdamW; hidden_optimizer {recipe['hidden_optimizer']} keeps one "
                     "state, not two, for the hidden weights: an upper bound")
    return notes, gathered


def build_plan(recipe: dict[str, Any], launch: Launch, text_cfg: dict[str, Any], dataset_tokens: float | None, *,
               draft_vocab: int = 32000, mean_document: float | None = None, hardware: Hardware | None = None,
               extraction: ExtractionInputs | None = None) -> Plan:
    """Everything `eagle3-hf plan` prints (`format_plan` formats it), for the recipe's `drafter_kind`; `hardware`
    and `extraction` default to their records' defaults (an H100, the extraction derived from the verifier)."""
    hardware, extraction = hardware or Hardware(), extraction or ExtractionInputs()
    drafter = drafter_arithmetic(recipe, text_cfg, draft_vocab)
    record = drafter.record()
    params = record.params
    micro_tokens = int(recipe.get("per_device_train_batch_size", 1)) * int(recipe.get("max_seq_len", 2048))
    dtype = "bf16" if recipe.get("bf16") else "fp32"
    memory = _memory(drafter, params, launch, micro_tokens, dtype, hardware)
    notes, gathered = _notes(recipe, drafter, params, memory, launch, hardware)
    ranks = max(1, launch.num_processes // max(1, launch.num_machines))
    verifier = verifier_params(text_cfg)
    nodes = max(1, launch.num_machines)
    extract_gpus = extraction.gpus or 8 * nodes
    weights = extraction.verifier_weights or footprint(text_cfg, "bfloat16")
    engine = engine_size(weights.bytes, weights.describe(), hardware.gpu_memory_gib, max(1, extract_gpus // nodes),
                         extraction.gpus_per_engine)
    node_tps = extraction.tokens_per_s or node_prefill_tokens_per_s(verifier["active"], extract_gpus, hardware.mfu,
                                                                    hardware.peak_tflops)
    plan = Plan(
        drafter=record, launch=launch, micro_batch_tokens=micro_tokens, dtype=dtype, memory=memory,
        step_peak_holds=drafter.step_peak_holds, notes=notes, zero3_gathered_per_micro_step=gathered,
        shm=shm_plan(recipe, ranks, drafter.feature_hidden),
        reader=reader_plan(int(text_cfg["hidden_size"]), node_tps, extract_gpus, engine.gpus_per_engine,
                           extraction.reader_gbps, nodes),
        verifier=VerifierSummary(int(text_cfg["num_hidden_layers"]), int(text_cfg["hidden_size"]),
                                 int(text_cfg["vocab_size"]), verifier, weights.bytes, weights.describe(), engine))
    if dataset_tokens:
        doc = min(mean_document or micro_tokens, int(recipe.get("max_seq_len", 2048)))
        # the extraction's budget: prefill tokens/s (given, or the FLOPs at MFU on extract_gpus) against the disks
        plan.extraction = extraction_budget(
            dataset_tokens, node_tps, "assumed, --extract-tokens-per-s" if extraction.tokens_per_s
            else f"2 x active FLOPs at {hardware.mfu:.0%} MFU on {extract_gpus} GPUs",
            drafter.feature_bytes_per_token("bf16"), hardware.disk_gbps, nodes)
        plan.data = data_plan(recipe, launch, drafter, dataset_tokens, doc, 2 * verifier["active"] * dataset_tokens,
                              extract_gpus, hardware)
    return plan


def data_plan(recipe: dict[str, Any], launch: Launch, drafter: DrafterArithmetic, dataset_tokens: float,
              mean_document: float, extract_flops: float, extract_gpus: int, hardware: Hardware) -> DataPlan:
    """The dataset's disk, the extraction's and the training's FLOPs and hours, the feature reads: what a node
    must read per second for its GPUs never to wait (the training tokens/s at the planned MFU times a token's
    bf16 feature bytes; bench/dataset_read.py measures what a node reads) and what bounds the run."""
    train_tokens = dataset_tokens * (1 - float(recipe.get("validation_fraction", 0.0)))
    per_token_flops = drafter.train_flops_per_token(mean_document)
    epoch_flops = train_tokens * per_token_flops
    rate = hardware.peak_tflops * 1e12 * hardware.mfu
    epochs = float(recipe.get("num_train_epochs", 1))
    compute_hours = epochs * epoch_flops / rate / 3600 / launch.num_processes
    stored = stored_dtype(feature_dtype(recipe.get("features")))
    read_tokens = rate / per_token_flops * max(1, launch.num_processes // max(1, launch.num_machines))
    return DataPlan(
        tokens=dataset_tokens, mean_document_tokens=mean_document,
        disk_bf16=drafter.feature_bytes_per_token("bf16") * dataset_tokens,
        disk_fp8=drafter.feature_bytes_per_token("fp8") * dataset_tokens,
        extract_flops=extract_flops, extract_gpu_hours=extract_flops / rate / 3600,
        extract_hours=extract_flops / rate / 3600 / extract_gpus, extract_gpus=extract_gpus,
        epoch_flops=epoch_flops, epoch_hours=epoch_flops / rate / 3600 / launch.num_processes,
        epochs=epochs, mfu=hardware.mfu, peak_tflops=hardware.peak_tflops, features_dtype=stored,
        reads=training_reads(recipe, launch, dataset_tokens, drafter.feature_bytes_per_token(stored), epochs,
                             hardware.disk_gbps, compute_hours),
        read_tokens_per_s_per_node=read_tokens,
        read_bytes_per_s_per_node=read_tokens * drafter.feature_bytes_per_token("bf16"))


def format_plan(plan: Plan, title: str) -> str:
    m, lc = plan.memory, plan.launch
    zero = f"DeepSpeed ZeRO-{lc.zero_stage}" if lc.zero_stage else "no DeepSpeed"
    offload = [w for w, on in (("optimizer", lc.offload_optimizer), ("params", lc.offload_param)) if on]
    lines = [
        f"plan: {title}",
        f"  launch      {lc.num_processes} GPU(s) on {lc.num_machines} machine(s), {zero}"
        + (f", offload {' + '.join(offload)} to CPU" if offload else "") + f", {plan.dtype}",
        *plan.drafter.lines(),
        f"  memory/GPU  model states {m.model_states / GIB:7.1f} GiB  ({m.model_states_rule})",
        f"              step peak    {m.step_peak / GIB:7.1f} GiB  ({plan.step_peak_holds}, "
        f"{plan.micro_batch_tokens} tokens/micro-batch)",
        *([f"              DDP buckets  {m.ddp_buckets / GIB:7.1f} GiB  (the reducer's fp32 copy of the gradients)"]
          if m.ddp_buckets else []),
        f"              total        {m.total / GIB:7.1f} GiB  of {m.gpu_memory_gib:g} GiB "
        f"({m.reserve_gib:g} GiB kept for the CUDA context)",
    ]
    if m.cpu_offload:
        lines.append(f"              CPU RAM      {m.cpu_offload / GIB:7.1f} GiB per node (DeepSpeed's estimate: "
                     f"{'offloaded states' if lc.offload_optimizer else 'loading the model'})")
    lines.append("  verdict     " + ("fits" if m.fits else
                                     f"DOES NOT FIT: needs {m.total / GIB:.1f} GiB per GPU, has "
                                     f"{m.gpu_memory_gib - m.reserve_gib:g} usable"))
    lines += [f"  note        {n}" for n in plan.notes]
    lines += _verifier_lines(plan.verifier, m.gpu_memory_gib)
    lines += plan.reader.lines()
    if plan.data is not None:
        x = plan.data
        lines += [
            f"  features    {x.tokens / 1e6:.1f} M tokens: {x.disk_bf16 / GIB:,.1f} GiB bf16, "
            f"{x.disk_fp8 / GIB:,.1f} GiB fp8",
            f"  extraction  {x.extract_flops:.2e} FLOPs (2 x active x tokens): {x.extract_gpu_hours:.1f} "
            f"GPU-hours, {x.extract_hours:.2f} h on {x.extract_gpus} GPUs",
            *(plan.extraction.lines() if plan.extraction else []),
            f"  training    {x.epoch_flops:.2e} FLOPs/epoch (documents ~{x.mean_document_tokens:.0f} tokens): "
            f"{x.epoch_hours:.2f} h/epoch, {x.reads.compute_hours:.2f} h of compute for {x.epochs:g} epochs "
            f"on {lc.num_processes} GPU(s)",
            f"              at {x.mfu:.0%} MFU of {x.peak_tflops:g} TFLOP/s bf16 per GPU",
            f"  reading     {x.read_tokens_per_s_per_node / 1e3:,.0f} k tokens/s per node = "
            f"{x.read_bytes_per_s_per_node / 1e9:.2f} GB/s of bf16 features, for the GPUs never to wait",
            *x.reads.lines(x.epochs),
        ]
    lines.append(shm_plan_line(plan.shm))
    return "\n".join(lines)


def _verifier_lines(v: VerifierSummary, gpu_memory_gib: float) -> list[str]:
    e = v.engine
    lines = [f"  verifier    {v.layers} layers, hidden {v.hidden_size}, vocab {v.vocab_size}: "
             f"{v.params['total'] / 1e9:.1f} B parameters, {v.params['active'] / 1e9:.1f} B active per token",
             f"              weights {v.weights}",
             f"              an extraction engine spans {e.gpus_per_engine} GPU(s) of {gpu_memory_gib:g} GiB: "
             f"the weights take {e.weight_share:.0%} of them"
             + (" (--extract-gpus-per-engine)" if not e.derived else " (the fewest holding them at 80 %)"
                if e.gpus_at_80 <= e.gpus_per_engine else f" (a node's; {e.gpus_at_80} would hold them at 80 %)")
             + ("; little room is left for the KV cache (larger GPUs, or a lower --vllm-batch-size)"
                if e.weight_share > 0.8 and not e.problem else "")]
    if e.problem:
        lines.append(f"  verdict     DOES NOT FIT: {e.problem}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="training recipe YAML (what the training script takes as --config)")
    parser.add_argument("--accelerate-config", default=None, help="accelerate config YAML (default: 1 process)")
    parser.add_argument("--verifier-config", default=None, help="verifier config.json (default: the recipe's verifier)")
    parser.add_argument("--dataset-tokens", type=float, default=None,
                        help="tokens in the dataset, for disk and FLOPs (default: counted in the recipe's "
                             "features directory)")
    parser.add_argument("--mean-document-tokens", type=float, default=None,
                        help="mean conversation length for attention FLOPs (default: from the features "
                             "directory, else a row)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="draft vocabulary size (default: the features directory's vocab.safetensors, else 32000)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="per GPU (H100 80, H200 141)")
    parser.add_argument("--reserve-gib", type=float, default=2.0, help="kept back for the CUDA context, NCCL")
    parser.add_argument("--mfu", type=float, default=0.35, help="assumed model FLOPs utilisation")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200 989)")
    parser.add_argument("--extract-gpus", type=int, default=None,
                        help="GPUs running the verifier for extraction, every node's (default: 8 per machine of the "
                             "accelerate config)")
    parser.add_argument("--extract-gpus-per-engine", type=int, default=None,
                        help="GPUs per vLLM engine (its tensor x pipeline parallel size: 8 for Kimi-K2.5, 1 for an "
                             "8B model run as 8 replicas), for the readers each engine needs (default: the fewest, a "
                             "power of two, whose --gpu-memory-gib at 80 %% holds the verifier's weights; refused "
                             "when the weights exceed the engine's GPUs)")
    parser.add_argument("--verifier-dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                        help="dtype the engines load the verifier in (default auto: the checkpoint's, bf16 for an "
                             "fp32 one; a quantized checkpoint is sized as stored)")
    parser.add_argument("--reader-gbps", type=float, default=READER_GBPS,
                        help="GB/s of vLLM's connector files one reader thread of `extract --engine vllm` takes "
                             "(default: bench/vllm_reader.py's measurement, docs/results/vllm_reader.md)")
    parser.add_argument("--extract-tokens-per-s", type=float, default=None,
                        help="prefill tokens/s the extraction reaches, all its GPUs together (default: 2 x active "
                             "FLOPs per token at --mfu on --extract-gpus)")
    parser.add_argument("--disk-gbps", type=float, default=2.0,
                        help="GB/s one node's feature disk sustains, written by the extraction and read by every "
                             "epoch of training (default 2; a shared filesystem: its total over the nodes)")
    parser.add_argument("--json", default=None, help="also write the plan to this file")


def run(args: argparse.Namespace) -> int:
    recipe = load_yaml_or_json(args.recipe)
    launch = read_launch(args.accelerate_config, recipe)
    tokens, mean_document = args.dataset_tokens, args.mean_document_tokens
    if tokens is None and (found := dataset_from_features(recipe)):
        tokens, mean_document = found[0], mean_document or found[1]
    text_cfg = verifier_text_config(recipe, args.verifier_config)
    hardware = Hardware(gpu_memory_gib=args.gpu_memory_gib, reserve_gib=args.reserve_gib, mfu=args.mfu,
                        peak_tflops=args.peak_tflops, disk_gbps=args.disk_gbps)
    extraction = ExtractionInputs(
        gpus=args.extract_gpus, gpus_per_engine=args.extract_gpus_per_engine, tokens_per_s=args.extract_tokens_per_s,
        reader_gbps=args.reader_gbps,
        verifier_weights=verifier_weights(recipe, args.verifier_config, args.verifier_dtype, text_cfg))
    plan = build_plan(recipe, launch, text_cfg, tokens,
                      draft_vocab=args.draft_vocab or draft_vocab_from_features(recipe) or 32000,
                      mean_document=mean_document, hardware=hardware, extraction=extraction)
    title = f"{args.recipe}" + (f" with {args.accelerate_config}" if args.accelerate_config else "")
    print(format_plan(plan, title))
    if tokens is None:
        print("  (no dataset size: pass --dataset-tokens, or point the recipe's features at an extracted directory, "
              "for disk, FLOPs and time)")
    if args.json:
        Path(args.json).write_text(json.dumps(plan_json(plan), indent=1), encoding="utf-8")
    return 0 if plan.fits else 1
