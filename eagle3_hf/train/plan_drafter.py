"""The plan's drafter arithmetic: per drafter kind, one object that knows its parameters, the activation memory of a
training step, its FLOPs per token and the features it reads. `plan` picks it by the recipe's `drafter_kind`
(default eagle3) and computes everything else (model states, disk, time) from what it answers, so a new drafter
kind is one class here, named by its row in engines/table.py (`plan`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

from ..errors import UsageError

if TYPE_CHECKING:
    from ..model.configuration_dflash import DFlashConfig
    from ..model.configuration_eagle3 import Eagle3Config


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


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the drafter as trained: those the optimizer updates, the frozen ones it carries (verifier
    embedding, teacher rows, a frozen head), and its largest module (ZeRO-3's gather unit)."""

    trained: int
    frozen: int
    largest_layer: int


@dataclass(frozen=True)
class ActivationElements:
    """Elements alive at a training step's candidate peaks, by what holds them (`activation_elements`)."""

    fp32_norm_inputs: float  # RMSNorm inputs, fp32 under bf16
    saved: float  # what autograd saves for the backward
    logits: float
    teacher_probs: float  # fp32
    loss_block: float  # fp32 rows the loss handles at a time
    logit_grad: float  # the gradient of one step's logits


@dataclass(frozen=True)
class Eagle3Drafter:
    """The drafter's line of the plan: its shape and parameter counts."""

    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    ttt_steps: int
    lm_head: str  # "trained" or "frozen"
    params: ParamCounts

    def lines(self) -> list[str]:
        p = self.params
        return [f"  drafter     hidden {self.hidden_size}, {self.heads} heads x {self.head_dim} ({self.kv_heads} KV), "
                f"intermediate {self.intermediate_size}, draft vocab {self.draft_vocab_size}, TTT {self.ttt_steps}, "
                f"lm_head {self.lm_head}",
                f"              {p.trained / 1e9:.3f} B trained + {p.frozen / 1e9:.3f} B frozen "
                f"(verifier embedding, teacher rows{', lm_head' if self.lm_head == 'frozen' else ''})"]


class DrafterRecord(Protocol):
    """What the plan prints and writes about the drafter: a dataclass of its shape (written as is) and its
    parameter counts (written as `params_*`)."""

    @property
    def params(self) -> ParamCounts: ...

    def lines(self) -> list[str]: ...


class DrafterArithmetic(Protocol):
    """One drafter kind's arithmetic, as `plan` uses it."""

    feature_hidden: int  # the verifier hidden size of the features a token's training reads
    step_peak_holds: str  # what the step peak is made of, as the plan prints it
    zero3_gathers: str  # what ZeRO-3 gathers more than once per micro-batch, as the plan's note says it

    def record(self) -> DrafterRecord: ...

    def params(self) -> ParamCounts: ...

    def step_peak_bytes(self, tokens: int, grad_bytes: float, dtype: str = "fp32", loss_fraction: float = 1.0,
                        autocast_params: int = 0) -> int: ...

    def train_flops_per_token(self, mean_document: float) -> float: ...

    def zero3_gathered_bytes(self) -> int: ...

    def feature_bytes_per_token(self, dtype: str) -> int: ...


class Eagle3Arithmetic:
    """EAGLE-3's: one decoder layer unrolled `ttt_steps` times over fc(three aux states), the verifier's embedding
    frozen, the teacher's rows attached for the soft cross-entropy."""

    step_peak_holds = "TTT activations + logits + loss"
    zero3_gathers = "the frozen embedding and the layer at every TTT step"

    def __init__(self, config: Eagle3Config, ttt_steps: int, freeze_lm_head: bool = False):
        nkv, hd, target = config.num_key_value_heads, config.head_dim, config.target_hidden_size
        assert nkv is not None and hd is not None and target is not None  # Eagle3Config.__post_init__ fills them
        self.config, self.ttt_steps, self.freeze_lm_head = config, ttt_steps, freeze_lm_head
        self.kv_heads, self.head_dim, self.feature_hidden = nkv, hd, target

    def record(self) -> Eagle3Drafter:
        c = self.config
        return Eagle3Drafter(c.hidden_size, c.num_attention_heads, self.kv_heads, self.head_dim, c.intermediate_size,
                             c.draft_vocab_size, self.ttt_steps, "frozen" if self.freeze_lm_head else "trained",
                             self.params())

    def params(self) -> ParamCounts:
        """Trained / frozen parameters of the drafter (built on the meta device: no memory) and its largest
        module, plus the frozen teacher rows [draft_vocab, target_hidden] attached for training."""
        import torch

        from ..model.modeling_eagle3 import Eagle3DraftModel

        with torch.device("meta"):
            model = Eagle3DraftModel(self.config)
        model.lm_head.weight.requires_grad_(not self.freeze_lm_head)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        teacher = self.config.draft_vocab_size * self.feature_hidden
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        return ParamCounts(trained, frozen + teacher, max(largest, teacher))

    def activation_elements(self, tokens: int, loss_tokens: float) -> ActivationElements:
        """Elements alive at the TTT step's two candidate peaks, by what holds them.

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

        c, steps = self.config, self.ttt_steps
        h, inter, vd, nh = c.hidden_size, c.intermediate_size, c.draft_vocab_size, c.num_attention_heads
        nkv, hd = self.kv_heads, self.head_dim
        a, kv = nh * hd, nkv * hd
        per_step = 5 * h + 3 * a + nh + 2 * kv + 2 * hd + 3
        per_read_step = 6 * h + 4 * inter
        diagonal = (steps - 1) * (a + 16 * nh + 2 * kv + 16 * nkv) + a * steps * (steps - 1) // 2
        return ActivationElements(
            fp32_norm_inputs=(2 * tokens + 2 * loss_tokens) * h * steps,
            saved=tokens * (steps * per_step + diagonal + h) + loss_tokens * steps * per_read_step,  # + fc
            logits=loss_tokens * steps * vd,
            teacher_probs=loss_tokens * vd,
            loss_block=min(max(1, LOSS_CHUNK_ELEMENTS // vd), math.ceil(loss_tokens)) * vd,
            logit_grad=loss_tokens * vd)

    def step_peak_bytes(self, tokens: int, grad_bytes: float, dtype: str = "fp32", loss_fraction: float = 1.0,
                        autocast_params: int = 0) -> int:
        """Peak bytes of one micro-batch step above the resident model states: the largest of the end of the
        forward and loss, the loss's backward (the last step's logit gradient) and the last TTT step's layer
        backward with all gradients allocated. `loss_fraction`: share of positions the heads read (scored
        positions). bf16: 2-byte activations and logits, fp32 RMSNorm inputs, teacher and loss blocks;
        `autocast_params` fp32 weights that autocast holds a bf16 copy of while it runs."""
        e = self.activation_elements(tokens, tokens * loss_fraction)
        act = 4 if dtype == "fp32" else 2
        fp32_extra = 0 if dtype == "fp32" else 2 * e.fp32_norm_inputs
        saved = e.saved * act + fp32_extra
        held = saved + 2 * autocast_params + e.logits * act + e.teacher_probs * 4
        teacher_cast = 0 if dtype == "fp32" else e.teacher_probs * act  # head output before its fp32 copy
        block = e.loss_block * 4
        forward_end = held + max(teacher_cast, 3 * block)  # a block's teacher rows, log-softmax and product
        loss_backward = held + e.logit_grad * act + 4 * block  # the logits' gradient, a block's softmax terms
        layer_backward = held - (saved + e.logits * act) / self.ttt_steps + grad_bytes  # last step's layer, grads
        return int(max(forward_end, loss_backward, layer_backward))

    def train_flops_per_token(self, mean_document: float) -> float:
        """Model FLOPs of a training step per token: 6 x every trained linear it passes (fc once; attention, MLP
        and lm_head per TTT step; 4 x for a frozen lm_head), 12 x nh*hd per attended (query, key) pair (causal
        within a document of `mean_document` tokens plus i diagonal keys at step i), the teacher head forward."""
        c, steps = self.config, self.ttt_steps
        h, inter, vd, nh = c.hidden_size, c.intermediate_size, c.draft_vocab_size, c.num_attention_heads
        nkv, hd, target = self.kv_heads, self.head_dim, self.feature_hidden
        layer = 2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter
        linear = 6 * 3 * target * h + steps * (6 * layer + (4 if self.freeze_lm_head else 6) * vd * h)
        pairs = steps * (mean_document + 1) / 2 + sum(range(steps))
        return linear + 12 * nh * hd * pairs + 2 * vd * target

    def zero3_gathered_bytes(self) -> int:
        """bf16 bytes ZeRO-3 all-gathers per micro-step: a module's partitioned weights are gathered at every call
        and released after it, so those the TTT unroll calls once per step (the frozen verifier embedding, the
        layer) are gathered `ttt_steps` times in the forward and again in the backward (the layer's); fc, lm_head
        (once over every step's rows) and the teacher rows once each way (the frozen ones forward only)."""
        c = self.config
        h, inter, vd, nh = c.hidden_size, c.intermediate_size, c.draft_vocab_size, c.num_attention_heads
        nkv, hd, target = self.kv_heads, self.head_dim, self.feature_hidden
        layer = 2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter + 3 * h
        embed, fc, head, teacher = c.vocab_size * h, 3 * target * h, vd * h, vd * target
        elements = (self.ttt_steps * (embed + 2 * layer + 2 * h) + 2 * fc + (1 if self.freeze_lm_head else 2) * head
                    + teacher)
        return 2 * elements

    def feature_bytes_per_token(self, dtype: str) -> int:
        """A token's stored features: the three aux states and the last hidden state (the shard writer's)."""
        return feature_bytes_per_token(self.feature_hidden, dtype)


def eagle3_arithmetic(recipe: dict[str, Any], text_cfg: dict[str, Any], draft_vocab: int) -> Eagle3Arithmetic:
    """EAGLE-3's arithmetic for a recipe on a verifier: the drafter `train` builds (`ttt_steps`, `freeze_lm_head`)."""
    from ..model.configuration_eagle3 import Eagle3Config

    if draft_vocab > int(text_cfg["vocab_size"]):
        raise UsageError(f"draft vocabulary {draft_vocab} is larger than the verifier's {text_cfg['vocab_size']}: "
                         "pass --draft-vocab")
    steps = int(recipe.get("ttt_steps", 3))
    config = Eagle3Config.from_verifier(text_cfg, draft_vocab_size=draft_vocab, ttt_steps=steps)
    return Eagle3Arithmetic(config, steps, bool(recipe.get("freeze_lm_head", False)))


@dataclass(frozen=True)
class DFlashDrafter:
    """A DFlash drafter's line of the plan: its shape, the blocks a packed row trains, and its parameter counts."""

    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    layers: int
    block_size: int
    anchors_per_row: int
    params: ParamCounts

    def lines(self) -> list[str]:
        p = self.params
        return [f"  drafter     DFlash, {self.layers} layers, hidden {self.hidden_size}, {self.heads} heads x "
                f"{self.head_dim} ({self.kv_heads} KV), intermediate {self.intermediate_size}, full vocab "
                f"{self.vocab_size}, blocks of {self.block_size} at {self.anchors_per_row} anchors per row",
                f"              {p.trained / 1e9:.3f} B trained + {p.frozen / 1e9:.3f} B frozen "
                "(verifier embedding, lm_head)"]


class DFlashArithmetic:
    """DFlash's: fc(aux states) gives every token's context keys and values in each of N layers; `anchors_per_row`
    blocks of `block_size` tokens per packed row run through the layers, attending to their document's context and
    themselves; logits and the teacher are over the verifier's full vocabulary at block positions 1 .. B - 1."""

    step_peak_holds = "block activations + full-vocabulary logits + teacher + loss"
    zero3_gathers = "every layer each way, the frozen embedding, and the frozen lm_head for the logits, the teacher " \
                    "and the backward"

    def __init__(self, config: DFlashConfig, anchors_per_row: int, row_length: int):
        nkv, hd, target = config.num_key_value_heads, config.head_dim, config.target_hidden_size
        assert nkv is not None and hd is not None and target is not None  # DFlashConfig.from_verifier fills them
        self.config, self.row_length = config, row_length
        self.anchors = max(1, min(anchors_per_row, row_length))  # at most one anchor per position
        self.kv_heads, self.head_dim, self.feature_hidden = nkv, hd, target

    def record(self) -> DFlashDrafter:
        c = self.config
        return DFlashDrafter(c.hidden_size, c.num_attention_heads, self.kv_heads, self.head_dim, c.intermediate_size,
                             c.vocab_size, c.num_hidden_layers, c.block_size, self.anchors, self.params())

    def params(self) -> ParamCounts:
        """Trained (fc, layers, norms) / frozen (the verifier's embedding and lm_head) parameters of the model built
        on the meta device, and its largest module."""
        import torch

        from ..model.modeling_dflash import DFlashDraftModel

        with torch.device("meta"):
            model = DFlashDraftModel(self.config)
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        return ParamCounts(trained, frozen, largest)

    def activation_elements(self, rows: int, valid_anchors: float) -> ActivationElements:
        """Elements alive at the step's candidate peaks, by what holds them.

        Per context token (rows x row length): fc's output, hidden_norm's normed state and output, cos and sin,
        and per layer the context keys' k_proj output and k_norm's normed state (RoPE saves only cos and sin) and
        the keys and values the attention saves (2 x nh*hd after the GQA repeat, 2 x nkv*hd without one). Per
        block token (rows x anchors x block_size, invalid anchors included: they run, then are dropped): cos and
        sin, the final norm's two, and per layer 6 x hidden (two RMSNorms' inputs, normed states and outputs),
        5 x nh*hd (q's projection, its normed state and RoPE'd copy, the attention output and its reshaped copy),
        the block keys' 2 x nkv*hd, the attention's keys and values and 4 x intermediate (the MLP). The attention
        turns the boolean mask into an additive one per layer: (block query, key) elements each. Logits
        [anchors x (B - 1), V] and the fp32 teacher are over the full vocabulary; the loss runs per block position
        over blocks of `LOSS_CHUNK_ELEMENTS`, and each position's backward makes a whole gradient of the logits that
        autograd adds to the sum so far out of place: three alive."""
        from .loss import LOSS_CHUNK_ELEMENTS

        c = self.config
        h, inter, v, nh, layers = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_attention_heads, \
            c.num_hidden_layers
        nkv, hd, size = self.kv_heads, self.head_dim, int(c.block_size)
        a, kv = nh * hd, nkv * hd
        attn_kv = 2 * (a if nh > nkv else kv)
        context, block = rows * self.row_length, rows * self.anchors * size
        scored = valid_anchors * (size - 1)
        per_context = 3 * h + 2 * hd + layers * (2 * kv + nkv + attn_kv)
        per_block = 2 * h + 2 * hd + layers * (6 * h + 5 * a + 2 * kv + attn_kv + 4 * inter + 2 * nh + nkv)
        masks = layers * rows * self.anchors * size * (self.row_length + self.anchors * size)
        norm_inputs = context * (h + layers * kv) + block * (h + layers * (2 * h + a + kv))
        return ActivationElements(
            fp32_norm_inputs=norm_inputs,
            saved=context * per_context + block * per_block + masks,
            logits=scored * v,
            teacher_probs=scored * v,
            loss_block=min(max(1, LOSS_CHUNK_ELEMENTS // v), math.ceil(valid_anchors)) * v,  # one position's rows
            logit_grad=3 * scored * v)

    def step_peak_bytes(self, tokens: int, grad_bytes: float, dtype: str = "fp32", loss_fraction: float = 1.0,
                        autocast_params: int = 0) -> int:
        """Peak bytes of one micro-batch step above the resident model states: the largest of the teacher's
        softmax at the end of the forward (its fp32 logits beside its probabilities), the loss's backward (the
        logits' gradients) and the layers' backward with all gradients allocated. `loss_fraction`: share of the
        anchor slots that hold an anchor. bf16: 2-byte activations and logits, fp32 RMSNorm inputs, teacher and
        loss blocks; `autocast_params` fp32 weights that autocast holds a bf16 copy of while it runs."""
        rows = max(1, tokens // self.row_length)
        e = self.activation_elements(rows, rows * self.anchors * loss_fraction)
        act = 4 if dtype == "fp32" else 2
        fp32_extra = 0 if dtype == "fp32" else 2 * e.fp32_norm_inputs
        saved = e.saved * act + fp32_extra
        held = saved + 2 * autocast_params + e.logits * act + e.teacher_probs * 4
        block = e.loss_block * 4
        forward_end = held + max(e.teacher_probs * 4, 3 * block)  # the teacher's fp32 logits beside its softmax
        loss_backward = held + e.logit_grad * act + 4 * block
        layers_backward = held + grad_bytes
        return int(max(forward_end, loss_backward, layers_backward))

    def train_flops_per_token(self, mean_document: float) -> float:
        """Model FLOPs of a training step per token: 4 x fc (the features need no gradient) and 6 x each layer's
        context k/v projections for every token; per block token (anchors x block_size per row of `row_length`)
        6 x the layer's linears and 12 x nh*hd per attended key (the context before the anchor, half a document on
        average, and the block); per scored position 4 x the frozen lm_head (forward and input gradient) and 2 x
        for the teacher."""
        c = self.config
        h, inter, v, nh, layers = c.hidden_size, c.intermediate_size, c.vocab_size, c.num_attention_heads, \
            c.num_hidden_layers
        nkv, hd, target, size = self.kv_heads, self.head_dim, self.feature_hidden, int(c.block_size)
        context = 4 * 3 * target * h + layers * 6 * 2 * h * nkv * hd
        layer = h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter
        keys = min(mean_document, self.row_length) / 2 + size
        block_tokens = self.anchors * size / self.row_length
        scored = self.anchors * (size - 1) / self.row_length
        return context + block_tokens * layers * (6 * layer + 12 * nh * hd * keys) + scored * 6 * v * h

    def zero3_gathered_bytes(self) -> int:
        """bf16 bytes ZeRO-3 all-gathers per micro-step: fc, the norms and every layer (the trained parameters)
        forward and backward, the frozen embedding once, the frozen lm_head for the logits, the teacher and the
        logits' backward."""
        c = self.config
        return 2 * (2 * self.params().trained + 4 * c.vocab_size * c.hidden_size)

    def feature_bytes_per_token(self, dtype: str) -> int:
        """A token's stored features: the same as EAGLE-3's (aux states for the context, the last hidden state for
        the teacher)."""
        return feature_bytes_per_token(self.feature_hidden, dtype)


def dflash_arithmetic(recipe: dict[str, Any], text_cfg: dict[str, Any], draft_vocab: int) -> DFlashArithmetic:
    """DFlash's arithmetic for a recipe on a verifier: `block_size`, `dflash_layers` and `dflash_anchors` with the
    training defaults; the vocabulary is the verifier's whole one (`draft_vocab` does not apply)."""
    from ..model.configuration_dflash import DEFAULT_BLOCK_SIZE, DEFAULT_LAYERS, DFlashConfig
    from .dflash_loss import DEFAULT_ANCHORS_PER_ROW

    try:
        config = DFlashConfig.from_verifier(text_cfg, mask_token_id=0,  # any id: no parameter depends on it
                                            num_hidden_layers=int(recipe.get("dflash_layers", DEFAULT_LAYERS)),
                                            block_size=int(recipe.get("block_size", DEFAULT_BLOCK_SIZE)))
    except ValueError as e:
        raise UsageError(f"the recipe's DFlash drafter: {e}") from None
    anchors = int(recipe.get("dflash_anchors", DEFAULT_ANCHORS_PER_ROW))
    if anchors < 1:
        raise UsageError(f"the recipe's dflash_anchors {anchors} must be at least 1")
    return DFlashArithmetic(config, anchors, int(recipe.get("max_seq_len", 2048)))


def drafter_arithmetic(recipe: dict[str, Any], text_cfg: dict[str, Any], draft_vocab: int) -> DrafterArithmetic:
    """The arithmetic of the recipe's `drafter_kind` (default eagle3), from its row in engines/table.py; an unknown
    kind is refused in one line."""
    from ..engines.table import kind, kind_names

    name = str(recipe.get("drafter_kind", "eagle3"))
    try:
        row = kind(name)
    except ValueError:
        raise UsageError(f"the recipe's drafter_kind {name!r}: plan knows {', '.join(sorted(kind_names()))}") from None
    return cast("DrafterArithmetic", row.plan_function()(recipe, text_cfg, draft_vocab))
