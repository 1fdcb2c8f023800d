"""Attention over packed documents for the drafter's training-time-test unroll.

Several documents share a packed row and must never see each other; at TTT step i a position reads the token
i places later *in its own document* (`shift_within_documents`) and attends causally to its document's step-0
keys plus only its own keys of steps 1..i (the diagonal, `_causal_with_diagonals`). `Eagle3Attention` is
Llama's GQA attention with q/k/v over cat(embedding, hidden); it computes the diagonal pattern without
building the mask. What a query may see is the `keys` object the attention is called with: during the unroll
`PackedRowKeys` (one attention call per step over the whole batch, a mask from `document_ids` built on the
device: no host synchronisation, the accelerator path) or `PackedDocumentKeys` (one call per document and step,
less arithmetic: the CPU path), chosen by `packed_keys`; `DraftKeys` (a KV cache, causal or a tree mask) at
inference.

A sliding window (the config's `sliding_window` N) limits every query to the last N tokens before its own
position, itself included: key position j is seen from position p iff p - N < j <= p. At TTT step i a query of
token t sits at position t + i, so it sees its document's step-0 keys t + i - N < j <= t and all of its own
diagonal keys (positions t + 1 .. t + i): exactly what an engine's drafter sees with that window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from ..constants import PAD_DOCUMENT
from .configuration_eagle3 import Eagle3Config


def shift_within_documents(x: torch.Tensor, document_ids: torch.Tensor, shift: int,
                           fill: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """out[:, t] = x[:, t + shift] where that position is in the same document as t, else `fill`.

    Returns (out, valid). The one place where "step i reads i places later, never into the next document"
    is implemented; the trainer shifts targets with it too.
    """
    batch, length = document_ids.shape
    if shift == 0:
        return x, document_ids != PAD_DOCUMENT
    valid = torch.zeros_like(document_ids, dtype=torch.bool)
    out = torch.full_like(x, fill)
    if shift < length:
        same = (document_ids[:, shift:] == document_ids[:, :-shift]) & (document_ids[:, :-shift] != PAD_DOCUMENT)
        valid[:, :-shift] = same
        out[:, :-shift] = x[:, shift:]
        mask = valid.view(batch, length, *([1] * (x.dim() - 2)))
        out = torch.where(mask, out, torch.full_like(out, fill))
    return out, valid


def document_spans(document_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) spans of each document (padding excluded). Computed once per batch."""
    spans = []
    ids = document_ids.detach().cpu()
    for row in ids:
        values, counts = torch.unique_consecutive(row, return_counts=True)
        row_spans: list[tuple[int, int]] = []
        start = 0
        for value, count in zip(values.tolist(), counts.tolist()):
            if value != PAD_DOCUMENT:
                row_spans.append((start, start + count))
            start += count
        spans.append(row_spans)
    return spans


class Eagle3Attention(nn.Module):
    """Llama GQA attention whose q/k/v read 2 x hidden inputs: cat(embedding, hidden)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        head_dim, kv_heads = config.head_dim, config.num_key_value_heads
        assert head_dim is not None and kv_heads is not None  # LlamaConfig.__post_init__ fills both
        self.head_dim: int = head_dim
        self.num_heads: int = config.num_attention_heads
        self.num_key_value_heads: int = kv_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.layer_idx = 0
        in_features = 2 * config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                keys: TTTKeys | DraftKeys) -> torch.Tensor:
        """x [B, L, 2H] -> [B, L, H]: project, attend to what `keys` holds (the TTT unroll's per-document keys,
        or an inference cache), o_proj."""
        q, k, v = self.project(x, position_embeddings)
        return self.o_proj(keys.attend(self, q, k, v))  # [B, L, nh * hd] -> [B, L, H]

    def project(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, 2H] -> q [B, nh, L, hd], k and v [B, nkv, L, hd], RoPE applied."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor | BlockMask | None) -> torch.Tensor:
        """Through transformers' attention interface (eager / sdpa / flex), mask [B|1, 1, Lq, Lk] (additive;
        bool for sdpa) or a flex BlockMask.

        `mask=None` means causal (top-left aligned, query r sees keys 0..r): sdpa and the flash kernels take it
        as their causal fast path (no mask tensor, masked blocks skipped, GQA without copying keys); the other
        implementations, which read None as "no mask", get the explicit causal mask.
        """
        implementation = self.config._attn_implementation
        interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if mask is None and not (implementation == "sdpa" or implementation.startswith("flash_attention")):
            mask = _causal_mask(q.shape[2], k.shape[2], q.dtype, q.device)[None, None]
        out, _ = interface(self, q, k, v, mask, dropout=0.0, scaling=self.scaling, is_causal=mask is None)
        return out  # [B, Lq, nh, hd]

    def attend_with_diagonals(self, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
                              diag_keys: list[torch.Tensor], diag_values: list[torch.Tensor],
                              mask: torch.Tensor | BlockMask | None = None) -> torch.Tensor:
        """TTT step i = len(diag_keys): query t attends to the step-0 keys k0 the mask allows and to its own
        diagonal keys diag_keys[j][t] (steps 1..i). q [B, nh, n, hd], k0/v0 and each diagonal [B, nkv, n, hd].
        Returns [B, n, nh, hd]. Exact, in one call of the attention interface, without the i n x n diagonal
        blocks of which only the diagonals count:

        each diagonal key becomes a *virtual* key shared by all queries, placed before the step-0 keys. Keys
        and values get E extra feature dims (zero for k0 / v0); virtual key j is the unit vector on the dim(s)
        of slot j, virtual value j the unit vector on dim j. Query t carries its own diagonal score
        q_t . k_j[t] in slot j, so the kernel scores virtual key j exactly as diagonal j and the softmax
        normalises over step-0 and diagonal keys together; output dim hd + j is then the probability p_j(t),
        and the diagonal values are added back as sum_j p_j(t) v_j[t].

        `mask=None`: one document (B = 1), causal. i leading all-zero dummy queries (outputs dropped) put query
        t at row i + t, so plain causal attention shows it exactly keys 0..i+t = the i virtual keys and
        k0[:t+1]. Otherwise `mask` says what each query sees over [i virtual keys | k0] (`PackedRowKeys`:
        every virtual key, and the step-0 keys of its own document up to itself).

        When the kernel runs in half precision (half q/k/v, or autocast to a half dtype, which casts the
        attention's inputs), a score travels as a hi + lo pair (two dims of its slot) that the kernel sums in
        fp32, so it keeps fp32 precision.
        """
        batch, heads, n, head_dim = q.shape
        kv_heads, i = k0.shape[1], len(diag_keys)
        if i == 0:
            return self.attend(q, k0, v0, mask)
        groups = heads // kv_heads
        kernel = _kernel_dtype(q)
        acc = q.dtype if kernel in (torch.float32, torch.float64) else torch.float32
        qg = q.view(batch, kv_heads, groups, n, head_dim).to(acc)
        scores = torch.stack([(qg * kd.to(acc).unsqueeze(2)).sum(-1) for kd in diag_keys], dim=-1)
        scores = scores.reshape(batch, heads, n, i)  # raw q_t . k_j[t]; the interface applies the scaling
        scores, width = score_slots(scores, kernel)  # [B, nh, n, width * i]: width dims per slot
        extra = -(-width * i // 8) * 8  # head dims stay a multiple of 8 (flash kernels)
        dummy = i if mask is None else 0
        q_ext = F.pad(torch.cat([q, scores.to(q.dtype)], dim=-1), (0, extra - width * i, dummy, 0))
        slot = torch.arange(i, device=q.device)
        key_unit = q.new_zeros(i, head_dim + extra, dtype=k0.dtype)
        for w in range(width):
            key_unit[slot, head_dim + width * slot + w] = 1.0
        value_unit = q.new_zeros(i, head_dim + extra, dtype=v0.dtype)
        value_unit[slot, head_dim + slot] = 1.0
        k_ext = torch.cat([key_unit.expand(batch, kv_heads, i, -1), F.pad(k0, (0, extra))], dim=2)
        v_ext = torch.cat([value_unit.expand(batch, kv_heads, i, -1), F.pad(v0, (0, extra))], dim=2)
        out = self.attend(q_ext, k_ext, v_ext, mask)[:, dummy:]  # [B, n, nh, hd + extra]
        probs = out[..., head_dim : head_dim + i].unsqueeze(-2)  # [B, n, nh, 1, i]: p_j(t)
        diag_v = torch.stack(diag_values, dim=-1).transpose(1, 2).unsqueeze(3)  # [B, n, nkv, 1, hd, i]
        diag_v = diag_v.expand(batch, n, kv_heads, groups, head_dim, i).reshape(batch, n, heads, head_dim, i)
        return out[..., :head_dim] + (diag_v * probs.to(diag_v.dtype)).sum(-1)


def score_slots(scores: torch.Tensor, kernel: torch.dtype) -> tuple[torch.Tensor, int]:
    """The diagonal scores [B, nh, n, i] as the virtual keys' slots carry them: as they are for an fp32 (fp64)
    kernel (width 1); for a half-precision kernel each as a hi + lo pair of that dtype (width 2), hi the score
    rounded and lo its remainder, which the kernel's fp32 dot product sums back to the fp32 score. Rounded to bf16
    alone, a score of 100 would be off by up to 0.5: a factor e^0.5 on its softmax weight."""
    if kernel in (torch.float32, torch.float64):
        return scores, 1
    half = torch.bfloat16 if kernel == torch.bfloat16 else torch.float16
    hi = scores.to(half)
    pair = torch.stack([hi, (scores - hi.to(scores.dtype)).to(half)], dim=-1)  # [B, nh, n, i, 2]
    return pair.reshape(*scores.shape[:-1], 2 * scores.shape[-1]), 2


def _kernel_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype the attention kernel computes in: autocast casts its inputs (RoPE leaves q fp32 under it)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return q.dtype


class PackedDocumentKeys:
    """What a query sees during the TTT unroll: per document, causal over the step-0 keys plus its own keys of
    steps 1..i (the diagonal). Each step appends its keys; padding rows stay zero (never read)."""

    def __init__(self, spans: list[list[tuple[int, int]]], window: int | None = None):
        self.spans = spans  # per row: (start, end) of each document (`document_spans`)
        self.window = window
        self.keys: list[torch.Tensor] = []  # per step: [B, nkv, L, hd]
        self.values: list[torch.Tensor] = []

    def attend(self, attn: Eagle3Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, nh, L, hd] of step i = the number of steps seen before -> [B, L, nh * hd].

        Each tensor is split once into documents: a backward through per-document slices would fill a
        full-size zero gradient per slice."""
        self.keys.append(k)
        self.values.append(v)
        batch, heads, length, head_dim = q.shape
        rows = []
        for b in range(batch):
            sizes, docs, cursor = [], [], 0
            for start, end in self.spans[b]:
                if start > cursor:
                    sizes.append(start - cursor)
                docs.append(len(sizes))
                sizes.append(end - start)
                cursor = end
            if cursor < length:
                sizes.append(length - cursor)
            q_parts = q[b : b + 1].split(sizes, dim=2)
            k_parts = [key[b : b + 1].split(sizes, dim=2) for key in self.keys]
            v_parts = [value[b : b + 1].split(sizes, dim=2) for value in self.values]
            pieces = [q.new_zeros(n, heads * head_dim) for n in sizes]
            diagonals = len(self.keys) - 1
            for d in docs:
                mask = None  # causal: the fast path, exact while the window does not bind
                if self.window is not None and sizes[d] > self.window - diagonals:
                    allowed = band_mask(sizes[d], sizes[d], self.window - diagonals, q.device)
                    allowed = torch.cat([allowed.new_ones(sizes[d], diagonals), allowed], dim=-1)[None, None]
                    mask = _as_mask(allowed, attn.config._attn_implementation, q.dtype)
                out = attn.attend_with_diagonals(q_parts[d], k_parts[0][d], v_parts[0][d],
                                                 [key[d] for key in k_parts[1:]], [value[d] for value in v_parts[1:]],
                                                 mask)
                pieces[d] = out.reshape(sizes[d], heads * head_dim)  # [n, nh * hd]
            rows.append(torch.cat(pieces, dim=0))
        return torch.stack(rows, dim=0)


class PackedRowKeys:
    """The same pattern as `PackedDocumentKeys`, in one attention call per TTT step over the whole batch: the
    diagonal keys become virtual keys (`Eagle3Attention.attend_with_diagonals`) and a mask built once per
    batch on the device from `document_ids` keeps each query to its own document's step-0 keys up to itself.
    No host synchronisation, whatever the number of documents; attention is computed over whole rows (the
    GPU path: what recipes and gpu_check run)."""

    def __init__(self, document_ids: torch.Tensor, steps: int, window: int | None = None):
        self.document_ids, self.steps, self.window = document_ids, steps, window
        self.keys: list[torch.Tensor] = []  # per step: [B, nkv, L, hd]
        self.values: list[torch.Tensor] = []
        self._mask: torch.Tensor | None = None

    def attend(self, attn: Eagle3Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, nh, L, hd] of step i = the number of steps seen before -> [B, L, nh * hd]."""
        self.keys.append(k)
        self.values.append(v)
        batch, heads, length, head_dim = q.shape
        i = len(self.keys) - 1
        out = attn.attend_with_diagonals(q, self.keys[0], self.values[0], self.keys[1:], self.values[1:],
                                         self.mask(attn.config._attn_implementation, i, q.dtype))
        return out.reshape(batch, length, heads * head_dim)

    def mask(self, implementation: str, diagonals: int, dtype: torch.dtype) -> torch.Tensor | BlockMask:
        """What step `diagonals` sees over [virtual keys | step-0 keys]: bool [B, 1, L, i + L] for sdpa, additive
        for eager, a BlockMask (block-sparse over documents) for flex_attention."""
        window = None if self.window is None else self.window - diagonals  # step i's query sits i places later
        if implementation == "flex_attention":
            return document_block_mask(self.document_ids, diagonals, window)
        if window is not None:  # the band depends on the step
            return _as_mask(document_mask(self.document_ids, diagonals, window), implementation, dtype)
        if self._mask is None:  # built once per batch, for the largest number of virtual keys
            self._mask = document_mask(self.document_ids, self.steps - 1)
        return _as_mask(self._mask[..., self.steps - 1 - diagonals :], implementation, dtype)


def _as_mask(allowed: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: may attend) as the attention implementation takes it: bool for sdpa, additive else."""
    if implementation == "sdpa":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def band_mask(n_q: int, n_k: int, window: int | None, device: torch.device | str) -> torch.Tensor:
    """bool [n_q, n_k], rows and columns on one position axis: row r sees columns r - window < c <= r (all
    columns <= r without a window)."""
    rows = torch.arange(n_q, device=device)[:, None]
    cols = torch.arange(n_k, device=device)[None]
    allowed = cols <= rows
    return allowed if window is None else allowed & (rows - cols < window)


def document_mask(document_ids: torch.Tensor, virtual: int, window: int | None = None) -> torch.Tensor:
    """bool [B, 1, L, virtual + L]: every query sees the `virtual` leading keys, then the keys of its own
    document up to itself, the last `window` of them with a window (padding, id -1, sees earlier padding:
    finite, never read)."""
    batch, length = document_ids.shape
    same = document_ids[:, :, None] == document_ids[:, None, :]  # [B, L, L]
    causal = band_mask(length, length, window, document_ids.device)
    allowed = torch.cat([same.new_ones(batch, length, virtual), same & causal], dim=-1)
    return allowed[:, None]


def document_block_mask(document_ids: torch.Tensor, virtual: int, window: int | None = None) -> BlockMask:
    """`document_mask` as a flex_attention BlockMask: blocks of other documents (and outside the window) are
    skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, length = document_ids.shape
    reach = length if window is None else window

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        key = (kv_idx - virtual).clamp(min=0)
        own = (document_ids[b, q_idx] == document_ids[b, key]) & (key <= q_idx) & (q_idx - key < reach)
        return (kv_idx < virtual) | own

    return create_block_mask(mask_mod, batch, None, length, virtual + length, device=document_ids.device)


def packed_keys(document_ids: torch.Tensor, steps: int, mode: str = "auto",
                window: int | None = None) -> PackedRowKeys | PackedDocumentKeys:
    """The TTT unroll's keys: `row` (one attention call per step over the batch, no host synchronisation) or
    `document` (one call per document and step over its own keys only: less arithmetic, which wins on a CPU,
    where a host synchronisation costs nothing). `auto`: `document` on the CPU, `row` on any accelerator.
    `window`: the sliding window (module docstring)."""
    if window is not None and window < steps:
        raise ValueError(f"a sliding window of {window} tokens cannot hold {steps} TTT steps' own keys")
    if mode == "auto":
        mode = "document" if document_ids.device.type == "cpu" else "row"
    if mode == "row":
        return PackedRowKeys(document_ids, steps, window)
    if mode == "document":
        return PackedDocumentKeys(document_spans(document_ids), window)
    raise ValueError(f"packed attention must be 'auto', 'row' or 'document', not {mode!r}")


class DraftKeys:
    """What a query sees at inference: a KV cache plus the new positions, causally, or as `attention_mask`
    (bool [q, S + q], True: may attend) says for a draft tree. After `attend`, `present` is the grown cache.

    With a `window` N, a query at position p also sees only the cache entries c > p - N: the cache holds
    position c at entry c (the decoders grow and crop it from position 0), and a draft tree's own entries sit
    within its depth of the query."""

    def __init__(self, past: tuple[torch.Tensor, torch.Tensor] | None, attention_mask: torch.Tensor | None,
                 positions: torch.Tensor | None = None, window: int | None = None):
        self.past, self.attention_mask = past, attention_mask
        self.positions, self.window = positions, window  # positions [q]: the queries'
        self.present: tuple[torch.Tensor, torch.Tensor] | None = None

    def attend(self, attn: Eagle3Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, nh, q, hd], k/v [1, nkv, q, hd] -> [1, q, nh * hd]."""
        if self.past is not None:
            k = torch.cat([self.past[0], k], dim=2)  # [1, nkv, S + q, hd]
            v = torch.cat([self.past[1], v], dim=2)
        self.present = (k, v)
        new, total = q.shape[2], k.shape[2]
        allowed = (torch.ones(new, total, dtype=torch.bool, device=q.device).tril(total - new)
                   if self.attention_mask is None else self.attention_mask.to(q.device))
        if self.window is not None:
            if self.positions is None:
                raise ValueError("a windowed drafter's draft step needs the queries' positions")
            entries = torch.arange(total, device=q.device)[None]
            allowed = allowed & (self.positions.to(q.device)[:, None] - entries < self.window)
        mask = torch.zeros(new, total, dtype=q.dtype, device=q.device).masked_fill_(~allowed, torch.finfo(q.dtype).min)
        return attn.attend(q, k, v, mask[None, None]).reshape(1, new, -1)


TTTKeys = PackedRowKeys | PackedDocumentKeys


def _causal_mask(n_q: int, n_k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive top-left-aligned causal mask [n_q, n_k]: row r sees keys 0..r."""
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()
    return torch.zeros(n_q, n_k, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)


def _causal_with_diagonals(n: int, blocks: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Additive mask [n, blocks * n]: causal over the first block, the diagonal only over the others.

    The pattern a document's queries see at step blocks - 1 over keys [k_0 | k_1 .. k_i]; the unroll computes
    exactly this without building it (`Eagle3Attention.attend_with_diagonals`)."""
    allowed = torch.zeros(n, blocks * n, dtype=torch.bool, device=device)
    allowed[:, :n] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.arange(n, device=device)
    for j in range(1, blocks):
        allowed[eye, j * n + eye] = True
    mask = torch.zeros(n, blocks * n, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)
