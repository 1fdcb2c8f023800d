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

Time is the longer of the training's compute and its feature reads (plan_disk.py); the extraction engine spans the
GPUs that hold the verifier's weights (verifier/footprint.py), and a verifier no engine of a node can hold is a
DOES NOT FIT verdict.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from ..errors import UsageError
from ..verifier.footprint import Footprint, footprint, verifier_params
from .plan_disk import extraction_budget, extraction_lines, stored_dtype, training_read_lines, training_reads
from .plan_inputs import (
    Launch,
    dataset_from_features,
    draft_vocab_from_features,
    load_yaml_or_json,
    read_launch,
    verifier_text_config,
    verifier_weights,
)
from .plan_reader import READER_GBPS, engine_size, node_prefill_tokens_per_s, reader_lines, reader_plan
from .shm import feature_dtype, shm_plan, shm_plan_line

if TYPE_CHECKING:
    from ..model.configuration_eagle3 import Eagle3Config

GIB = 2**30


# ---------------------------------------------------------------------------------------------- the drafter


def _sizes(config: Eagle3Config) -> tuple[int, int, int]:
    """(num_key_value_heads, head_dim, target_hidden_size): typed optional, always set once the config is built."""
    nkv, hd, target = config.num_key_value_heads, config.head_dim, config.target_hidden_size
    assert nkv is not None and hd is not None and target is not None  # Eagle3Config.__post_init__ fills them
    return nkv, hd, target


def param_counts(config: Eagle3Config, freeze_lm_head: bool = False) -> dict[str, int]:
    """Trained / frozen parameters of the drafter (built on the meta device: no memory) and its largest
    module, plus the frozen teacher rows [draft_vocab, target_hidden] attached for training."""
    import torch

    from ..model.modeling_eagle3 import Eagle3DraftModel

    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    model.lm_head.weight.requires_grad_(not freeze_lm_head)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    teacher = config.draft_vocab_size * _sizes(config)[2]
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return {"trained": trained, "frozen": frozen + teacher, "largest_layer": max(largest, teacher)}


def step_activation_elements(config: Eagle3Config, tokens: int, loss_tokens: float,
                             ttt_steps: int) -> dict[str, float]:
    """Elements alive at the TTT step's two candidate peaks, by what holds them (see the module docstring).

    Per token and TTT step, autograd saves 5 x hidden (embedding, two RMSNorms, cat(embedding, hidden), the
    residual stream), 3 x nh*hd (q, its RoPE, the attention output) + nh, 2 x nkv*hd (RoPE'd k and v) and
    2 x head_dim (cos, sin); steps i >= 1 add the diagonal-key attention's extended q/k/v/output (per head 8
    more dims) and i x nh*hd for the diagonal values. Only where the output is read (`head_positions`: the
    scored positions, `loss_tokens`) the MLP block and the heads run: 6 x hidden (gathers, two RMSNorms, the
    sum) and 4 x intermediate (gate, up, SiLU, product) per step, the logits [scored, draft_vocab] that the
    soft cross-entropy keeps for its backward, and once the teacher's fp32 probabilities; the loss itself adds
    blocks of `LOSS_CHUNK_ELEMENTS`. Matches autograd's saved-tensor hooks at small shapes to within 1 %.
    """
    from .loss import LOSS_CHUNK_ELEMENTS

    h, inter, vd = config.hidden_size, config.intermediate_size, config.draft_vocab_size
    (nkv, hd, _), nh = _sizes(config), config.num_attention_heads
    a, kv = nh * hd, nkv * hd
    per_step = 5 * h + 3 * a + nh + 2 * kv + 2 * hd + 3
    per_read_step = 6 * h + 4 * inter
    diagonal = (ttt_steps - 1) * (a + 16 * nh + 2 * kv + 16 * nkv) + a * ttt_steps * (ttt_steps - 1) // 2
    return {
        "fp32_norm_inputs": (2 * tokens + 2 * loss_tokens) * h * ttt_steps,  # RMSNorm inputs, fp32 under bf16
        "saved": tokens * (ttt_steps * per_step + diagonal + h) + loss_tokens * ttt_steps * per_read_step,  # + fc
        "logits": loss_tokens * ttt_steps * vd,
        "teacher_probs": loss_tokens * vd,  # fp32
        "loss_block": min(max(1, LOSS_CHUNK_ELEMENTS // vd), math.ceil(loss_tokens)) * vd,  # fp32 rows at a time
        "logit_grad": loss_tokens * vd,  # the gradient of one step's logits
    }


def step_peak_bytes(config: Eagle3Config, tokens: int, ttt_steps: int, grad_bytes: float, dtype: str = "fp32",
                    loss_fraction: float = 1.0, autocast_params: int = 0) -> int:
    """Peak bytes of one micro-batch step above the resident model states: the largest of the end of the
    forward and loss, the loss's backward (the last step's logit gradient) and the last TTT step's layer
    backward with all gradients allocated. `loss_fraction`: share of positions the heads
    read (scored positions). bf16: 2-byte activations and logits, fp32 RMSNorm inputs, teacher and loss blocks;
    `autocast_params` fp32 weights that autocast holds a bf16 copy of while it runs."""
    e = step_activation_elements(config, tokens, tokens * loss_fraction, ttt_steps)
    act = 4 if dtype == "fp32" else 2
    fp32_extra = 0 if dtype == "fp32" else 2 * e["fp32_norm_inputs"]
    saved = e["saved"] * act + fp32_extra
    held = saved + 2 * autocast_params + e["logits"] * act + e["teacher_probs"] * 4
    teacher_cast = 0 if dtype == "fp32" else e["teacher_probs"] * act  # head output before its fp32 copy
    block = e["loss_block"] * 4
    forward_end = held + max(teacher_cast, 3 * block)  # a block's teacher rows, log-softmax and product
    loss_backward = held + e["logit_grad"] * act + 4 * block  # the logits' gradient, a block's softmax terms
    layer_backward = held - (saved + e["logits"] * act) / ttt_steps + grad_bytes  # last step's layer, grads
    return int(max(forward_end, loss_backward, layer_backward))


def train_flops_per_token(config: Eagle3Config, ttt_steps: int, mean_document: float,
                          lm_head_trained: bool = True) -> float:
    """Model FLOPs of a training step per token: 6 x every trained linear it passes (fc once; attention, MLP and
    lm_head per TTT step; 4 x for a frozen lm_head), 12 x nh*hd per attended (query, key) pair (causal within
    a document of `mean_document` tokens plus i diagonal keys at step i), the teacher head forward."""
    h, inter, vd = config.hidden_size, config.intermediate_size, config.draft_vocab_size
    (nkv, hd, target), nh = _sizes(config), config.num_attention_heads
    layer = 2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter
    linear = 6 * 3 * target * h + ttt_steps * (6 * layer + (6 if lm_head_trained else 4) * vd * h)
    pairs = ttt_steps * (mean_document + 1) / 2 + sum(range(ttt_steps))
    return linear + 12 * nh * hd * pairs + 2 * vd * target


# ---------------------------------------------------------------------------------------------- verifier, features


def feature_bytes_per_token(target_hidden: int, dtype: str) -> int:
    """Bytes the shard writer stores per token: input_ids and verifier_greedy int32, loss_mask uint8, three
    aux states and the last hidden state, and for fp8 one fp32 scale per hidden-size row (features/quantize.py)."""
    ids = 4 + 4 + 1
    if dtype == "bf16":
        return ids + 4 * target_hidden * 2
    if dtype == "fp8":
        return ids + 4 * target_hidden + 4 * 4
    if dtype == "fp32":
        return ids + 4 * target_hidden * 4
    raise ValueError(f"unknown feature dtype {dtype!r}")


# ---------------------------------------------------------------------------------------------- the plan


class ModelStates(TypedDict):
    gpu: float  # bytes per GPU
    cpu: float  # bytes per node, with offload
    rule: str  # how they were estimated


def model_state_bytes(params: dict[str, int], launch: Launch) -> ModelStates:
    """Per-GPU (and, with offload, per-node CPU) bytes of parameters, gradients and AdamW states."""
    trained, frozen = params["trained"], params["frozen"]
    gpus, nodes = launch.num_processes, launch.num_machines
    per_node = max(1, gpus // nodes)
    if launch.zero_stage == 0:
        return {"gpu": 16 * trained + 4 * frozen, "cpu": 0, "rule": "fp32 weights, gradients, AdamW states"}
    if launch.zero_stage in (1, 2):
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(trained, per_node, nodes, launch.offload_optimizer)
        if launch.zero_stage == 1:  # stage 1 keeps the full 16-bit gradients on every GPU
            gpu += 2 * trained * (1 - 1 / gpus)
        return {"gpu": gpu + 2 * frozen, "cpu": cpu,
                "rule": f"DeepSpeed estimate_zero2_model_states_mem_needs (stage {launch.zero_stage}) + bf16 frozen"}
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        trained, params["largest_layer"], per_node, nodes, launch.offload_optimizer, launch.offload_param,
        launch.zero_init)
    frozen_gpu = 0 if launch.offload_param else 2 * frozen / gpus
    return {"gpu": gpu + frozen_gpu, "cpu": cpu,
            "rule": "DeepSpeed estimate_zero3_model_states_mem_needs + bf16 frozen, partitioned"}


def ddp_bucket_bytes(params: dict[str, int], launch: Launch) -> int:
    """DDP's gradient buckets: without ZeRO and with more than one process, the reducer holds a flat fp32 copy
    of every trained gradient (transformers leaves `gradient_as_bucket_view` off), on top of the gradients."""
    return 4 * params["trained"] if launch.zero_stage == 0 and launch.num_processes > 1 else 0


def zero3_gathered_bytes(config: Eagle3Config, ttt_steps: int, freeze_lm_head: bool = False) -> int:
    """bf16 bytes ZeRO-3 all-gathers per micro-step: a module's partitioned weights are gathered at every call
    and released after it, so those the TTT unroll calls once per step (the frozen verifier embedding, the
    layer) are gathered `ttt_steps` times in the forward and again in the backward (the layer's); fc, lm_head
    (once over every step's rows) and the teacher rows once each way (the frozen ones forward only)."""
    h, inter, vd = config.hidden_size, config.intermediate_size, config.draft_vocab_size
    (nkv, hd, target), nh = _sizes(config), config.num_attention_heads
    layer = 2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter + 3 * h
    embed, fc, head, teacher = config.vocab_size * h, 3 * target * h, vd * h, vd * target
    elements = ttt_steps * (embed + 2 * layer + 2 * h) + 2 * fc + (1 if freeze_lm_head else 2) * head + teacher
    return 2 * elements


def build_plan(recipe: dict[str, Any], launch: Launch, text_cfg: dict[str, Any], dataset_tokens: float | None, *,
               draft_vocab: int = 32000, gpu_memory_gib: float = 80.0, reserve_gib: float = 2.0, mfu: float = 0.35,
               peak_tflops: float = 989.0, mean_document: float | None = None, extract_gpus: int | None = None,
               extract_tokens_per_s: float | None = None, disk_gbps: float = 2.0, gpus_per_engine: int | None = None,
               reader_gbps: float = READER_GBPS, verifier_weights: Footprint | None = None) -> dict[str, Any]:
    """Everything `eagle3-hf plan` prints, as a dict (the command formats it). `extract_gpus`: every node's (default
    8 per machine of the launch); `gpus_per_engine`: derived from the verifier's weights (`verifier_weights`, else
    its text config in bf16) when not given."""
    from ..model.configuration_eagle3 import Eagle3Config

    steps = int(recipe.get("ttt_steps", 3))
    if draft_vocab > int(text_cfg["vocab_size"]):
        raise UsageError(f"draft vocabulary {draft_vocab} is larger than the verifier's {text_cfg['vocab_size']}: "
                         "pass --draft-vocab")
    config = Eagle3Config.from_verifier(text_cfg, draft_vocab_size=draft_vocab, ttt_steps=steps)
    frozen_head = bool(recipe.get("freeze_lm_head", False))
    params = param_counts(config, frozen_head)
    micro_tokens = int(recipe.get("per_device_train_batch_size", 1)) * int(recipe.get("max_seq_len", 2048))
    dtype = "bf16" if recipe.get("bf16") else "fp32"
    states = model_state_bytes(params, launch)
    autocast = params["trained"] if dtype == "bf16" and launch.zero_stage == 0 else 0  # DeepSpeed: bf16 weights
    step = step_peak_bytes(config, micro_tokens, steps, 0, dtype, autocast_params=autocast)  # grads: in the states
    buckets = ddp_bucket_bytes(params, launch)
    total = states["gpu"] + step + buckets
    capacity = (gpu_memory_gib - reserve_gib) * GIB
    plan: dict[str, Any] = {
        "drafter": {"hidden_size": config.hidden_size, "heads": config.num_attention_heads,
                    "kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                    "intermediate_size": config.intermediate_size, "draft_vocab_size": draft_vocab,
                    "ttt_steps": steps, "lm_head": "frozen" if frozen_head else "trained",
                    **{f"params_{k}": v for k, v in params.items()}},
        "launch": vars(launch), "micro_batch_tokens": micro_tokens, "dtype": dtype,
        "memory": {"model_states": states["gpu"], "model_states_rule": states["rule"], "cpu_offload": states["cpu"],
                   "step_peak": step, "ddp_buckets": buckets, "total": total, "gpu_memory_gib": gpu_memory_gib,
                   "reserve_gib": reserve_gib,
                   "fits": total <= capacity},
        "notes": [],
    }
    if launch.zero_stage == 3:
        gathered = zero3_gathered_bytes(config, steps, frozen_head)
        plan["zero3_gathered_per_micro_step"] = gathered
        plan["notes"].append(f"ZeRO-3 all-gathers {gathered / GIB:.1f} GiB of bf16 weights per micro-batch (the frozen "
                             f"embedding and the layer at every TTT step); "
                             + ("DDP needs no gather: prefer it, the drafter fits one GPU" if
                                16 * params["trained"] + 4 * params["frozen"] + step + 4 * params["trained"]
                                <= capacity else "the drafter does not fit one GPU with DDP"))
    if recipe.get("hidden_optimizer", "adamw") != "adamw":
        plan["notes"].append(f"model states assume AdamW; hidden_optimizer {recipe['hidden_optimizer']} keeps one "
                             "state, not two, for the hidden weights: an upper bound")
    ranks = max(1, launch.num_processes // max(1, launch.num_machines))
    plan["shm"] = shm_plan(recipe, ranks, _sizes(config)[2])
    verifier = verifier_params(text_cfg)
    nodes = max(1, launch.num_machines)
    extract_gpus = extract_gpus or 8 * nodes
    weights = verifier_weights or footprint(text_cfg, "bfloat16")
    engine = engine_size(weights.bytes, weights.describe(), gpu_memory_gib, max(1, extract_gpus // nodes),
                         gpus_per_engine)
    node_tps = extract_tokens_per_s or node_prefill_tokens_per_s(verifier["active"], extract_gpus, mfu, peak_tflops)
    plan["reader"] = reader_plan(int(text_cfg["hidden_size"]), node_tps, extract_gpus, engine["gpus_per_engine"],
                                 reader_gbps, nodes)
    plan["verifier"] = {"layers": int(text_cfg["num_hidden_layers"]), "hidden_size": int(text_cfg["hidden_size"]),
                        "vocab_size": int(text_cfg["vocab_size"]), **{f"params_{k}": v for k, v in verifier.items()},
                        "weights_bytes": weights.bytes, "weights": weights.describe(), **engine}
    if dataset_tokens:
        doc = min(mean_document or micro_tokens, int(recipe.get("max_seq_len", 2048)))
        train_tokens = dataset_tokens * (1 - float(recipe.get("validation_fraction", 0.0)))
        epoch_flops = train_tokens * train_flops_per_token(config, steps, doc, lm_head_trained=not frozen_head)
        extract_flops = 2 * verifier["active"] * dataset_tokens
        rate = peak_tflops * 1e12 * mfu
        epochs = float(recipe.get("num_train_epochs", 1))
        per_token = feature_bytes_per_token(_sizes(config)[2], "bf16")
        # the extraction's budget: prefill tokens/s (given, or the FLOPs at MFU on extract_gpus) against the disks
        plan["extraction"] = extraction_budget(
            dataset_tokens, node_tps, "assumed, --extract-tokens-per-s" if extract_tokens_per_s
            else f"2 x active FLOPs at {mfu:.0%} MFU on {extract_gpus} GPUs", per_token, disk_gbps, nodes)
        compute_hours = epochs * epoch_flops / rate / 3600 / launch.num_processes
        stored = stored_dtype(feature_dtype(recipe.get("features")))
        plan["data"] = {
            "tokens": dataset_tokens, "mean_document_tokens": doc,
            "disk_bf16": feature_bytes_per_token(_sizes(config)[2], "bf16") * dataset_tokens,
            "disk_fp8": feature_bytes_per_token(_sizes(config)[2], "fp8") * dataset_tokens,
            "extract_flops": extract_flops, "extract_gpu_hours": extract_flops / rate / 3600,
            "extract_hours": extract_flops / rate / 3600 / extract_gpus, "extract_gpus": extract_gpus,
            "epoch_flops": epoch_flops, "epoch_hours": epoch_flops / rate / 3600 / launch.num_processes,
            "epochs": epochs, "mfu": mfu, "peak_tflops": peak_tflops, "features_dtype": stored,
            **training_reads(recipe, launch, dataset_tokens, feature_bytes_per_token(_sizes(config)[2], stored),
                             epochs, disk_gbps, compute_hours),
        }
        plan["data"].update(feature_read_rate(config, steps, doc, rate, launch, not frozen_head))
    return plan


def feature_read_rate(config: Eagle3Config, ttt_steps: int, mean_document: float, flops_per_gpu: float,
                      launch: Launch, lm_head_trained: bool = True) -> dict[str, float]:
    """What the loader must deliver per node for the GPUs never to wait: the training tokens/s at the planned
    MFU times the bf16 bytes a token's features take (bench/dataset_read.py measures what a node reads)."""
    per_gpu = flops_per_gpu / train_flops_per_token(config, ttt_steps, mean_document, lm_head_trained=lm_head_trained)
    gpus_per_node = max(1, launch.num_processes // max(1, launch.num_machines))
    tokens = per_gpu * gpus_per_node
    return {"read_tokens_per_s_per_node": tokens,
            "read_bytes_per_s_per_node": tokens * feature_bytes_per_token(_sizes(config)[2], "bf16")}


def format_plan(plan: dict[str, Any], title: str) -> str:
    d, m, lc = plan["drafter"], plan["memory"], plan["launch"]
    zero = f"DeepSpeed ZeRO-{lc['zero_stage']}" if lc["zero_stage"] else "no DeepSpeed"
    offload = [w for w, on in (("optimizer", lc["offload_optimizer"]), ("params", lc["offload_param"])) if on]
    lines = [
        f"plan: {title}",
        f"  launch      {lc['num_processes']} GPU(s) on {lc['num_machines']} machine(s), {zero}"
        + (f", offload {' + '.join(offload)} to CPU" if offload else "") + f", {plan['dtype']}",
        f"  drafter     hidden {d['hidden_size']}, {d['heads']} heads x {d['head_dim']} ({d['kv_heads']} KV), "
        f"intermediate {d['intermediate_size']}, draft vocab {d['draft_vocab_size']}, TTT {d['ttt_steps']}, "
        f"lm_head {d['lm_head']}",
        f"              {d['params_trained'] / 1e9:.3f} B trained + {d['params_frozen'] / 1e9:.3f} B frozen "
        f"(verifier embedding, teacher rows{', lm_head' if d['lm_head'] == 'frozen' else ''})",
        f"  memory/GPU  model states {m['model_states'] / GIB:7.1f} GiB  ({m['model_states_rule']})",
        f"              step peak    {m['step_peak'] / GIB:7.1f} GiB  (TTT activations + logits + loss, "
        f"{plan['micro_batch_tokens']} tokens/micro-batch)",
        *([f"              DDP buckets  {m['ddp_buckets'] / GIB:7.1f} GiB  (the reducer's fp32 copy of the gradients)"]
          if m.get("ddp_buckets") else []),
        f"              total        {m['total'] / GIB:7.1f} GiB  of {m['gpu_memory_gib']:g} GiB "
        f"({m['reserve_gib']:g} GiB kept for the CUDA context)",
    ]
    if m["cpu_offload"]:
        lines.append(f"              CPU RAM      {m['cpu_offload'] / GIB:7.1f} GiB per node (DeepSpeed's estimate: "
                     f"{'offloaded states' if lc['offload_optimizer'] else 'loading the model'})")
    lines.append("  verdict     " + ("fits" if m["fits"] else
                                     f"DOES NOT FIT: needs {m['total'] / GIB:.1f} GiB per GPU, has "
                                     f"{m['gpu_memory_gib'] - m['reserve_gib']:g} usable"))
    lines += [f"  note        {n}" for n in plan.get("notes", [])]
    v = plan["verifier"]
    lines.append(f"  verifier    {v['layers']} layers, hidden {v['hidden_size']}, vocab {v['vocab_size']}: "
                 f"{v['params_total'] / 1e9:.1f} B parameters, {v['params_active'] / 1e9:.1f} B active per token")
    lines += [f"              weights {v['weights']}",
              f"              an extraction engine spans {v['gpus_per_engine']} GPU(s) of {m['gpu_memory_gib']:g} GiB: "
              f"the weights take {v['weight_share']:.0%} of them"
              + (" (--extract-gpus-per-engine)" if not v["derived"] else " (the fewest holding them at 80 %)"
                 if v["gpus_at_80"] <= v["gpus_per_engine"] else f" (a node's; {v['gpus_at_80']} would hold them at "
                 "80 %)")
              + ("; little room is left for the KV cache (larger GPUs, or a lower --vllm-batch-size)"
                 if v["weight_share"] > 0.8 and not v.get("problem") else "")]
    if v.get("problem"):
        lines.append(f"  verdict     DOES NOT FIT: {v['problem']}")
    lines += reader_lines(plan["reader"]) if "reader" in plan else []
    if "data" in plan:
        x = plan["data"]
        lines += [
            f"  features    {x['tokens'] / 1e6:.1f} M tokens: {x['disk_bf16'] / GIB:,.1f} GiB bf16, "
            f"{x['disk_fp8'] / GIB:,.1f} GiB fp8",
            f"  extraction  {x['extract_flops']:.2e} FLOPs (2 x active x tokens): {x['extract_gpu_hours']:.1f} "
            f"GPU-hours, {x['extract_hours']:.2f} h on {x['extract_gpus']} GPUs",
            *extraction_lines(plan),
            f"  training    {x['epoch_flops']:.2e} FLOPs/epoch (documents ~{x['mean_document_tokens']:.0f} tokens): "
            f"{x['epoch_hours']:.2f} h/epoch, {x['compute_hours']:.2f} h of compute for {x['epochs']:g} epochs "
            f"on {lc['num_processes']} GPU(s)",
            f"              at {x['mfu']:.0%} MFU of {x['peak_tflops']:g} TFLOP/s bf16 per GPU",
            f"  reading     {x['read_tokens_per_s_per_node'] / 1e3:,.0f} k tokens/s per node = "
            f"{x['read_bytes_per_s_per_node'] / 1e9:.2f} GB/s of bf16 features, for the GPUs never to wait",
            *training_read_lines(x),
        ]
    if "shm" in plan:
        lines.append(shm_plan_line(plan["shm"]))
    return "\n".join(lines)


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
    plan = build_plan(recipe, launch, text_cfg, tokens,
                      draft_vocab=args.draft_vocab or draft_vocab_from_features(recipe) or 32000,
                      gpu_memory_gib=args.gpu_memory_gib, reserve_gib=args.reserve_gib,
                      mfu=args.mfu, peak_tflops=args.peak_tflops, mean_document=mean_document,
                      extract_gpus=args.extract_gpus, extract_tokens_per_s=args.extract_tokens_per_s,
                      disk_gbps=args.disk_gbps, gpus_per_engine=args.extract_gpus_per_engine,
                      reader_gbps=args.reader_gbps,
                      verifier_weights=verifier_weights(recipe, args.verifier_config, args.verifier_dtype, text_cfg))
    title = f"{args.recipe}" + (f" with {args.accelerate_config}" if args.accelerate_config else "")
    print(format_plan(plan, title))
    if tokens is None:
        print("  (no dataset size: pass --dataset-tokens, or point the recipe's features at an extracted directory, "
              "for disk, FLOPs and time)")
    if args.json:
        Path(args.json).write_text(json.dumps(plan, indent=1), encoding="utf-8")
    return 0 if plan["memory"]["fits"] and not plan["verifier"].get("problem") else 1
