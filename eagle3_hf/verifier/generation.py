"""Batched generation that keeps the verifier's EAGLE-3 features of every token it reads: the project's one
generation loop (plain `regenerate` runs it with features off, `aux_indices=None`).

`extract` runs the verifier once more over answers that generation already ran it over. Here the hidden
states of the generation itself are kept: the prefill gives the prompt's features, each decode step the
features of its input token, with the same definitions as `capture.py` (hooked aux layers, the decoder's
post-norm `last_hidden_state`, full-vocabulary argmax per position, which greedy decoding needs anyway).

A row is fed prompt + answer + `tail`: once it stops (an eos token, or `max_new_tokens` answer tokens) the
chat template's text after an answer (ChatML: `<|im_end|>` and a newline) is fed as forced input, one token
per step, so every token of the sample has its features (the final token is not dropped). Those steps cost
almost nothing: a batch runs until its longest row is done anyway. A stopping eos token is not part of the
answer; the tail supplies the template's end token, as `prepare` renders it.

Why not `generate()`: it computes logits of the last prompt position only, keeps finished rows in the batch,
and appends to its KV cache with `torch.cat` (O(length) copies per step and layer). Here finished rows leave
the batch, the KV cache is preallocated and written in place, and on the CPU the fp32 linears run on
prepacked oneDNN weights (cpu_linear.py: about 2x the default GEMM at 16-128 rows, a decode step's shape).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers.cache_utils import Cache, DynamicLayer

from .capture import aux_from, capture_layer_outputs, decoder_of
from .cpu_linear import prepacked_linears
from .family import logit_softcap, softcap_logits, text_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class PreallocatedLayer(DynamicLayer):
    """A DynamicLayer with room for `capacity` positions: update() writes in place and returns views."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.device = key_states.device
        self._k = key_states.new_empty(b, h, self.capacity, d)
        self._v = value_states.new_empty(b, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache full: {end} positions > capacity {self.capacity}")
        self._k[:, :, self.length:end] = key_states
        self._v[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]


@dataclass
class Generated:
    """One row's result: every token it read (prompt + answer + tail) and their features."""

    input_ids: list[int]
    answer: list[int]  # generated answer tokens (no stopping eos)
    finish_reason: str  # "stop" (eos) or "length" (max_new_tokens)
    aux_hidden_states: torch.Tensor | None  # [T, 3H]; None with features off
    last_hidden_state: torch.Tensor | None  # [T, H]
    verifier_greedy: torch.Tensor | None  # int64 [T]


@dataclass
class _Row:
    fed: list[int]
    forced: list[int] = field(default_factory=list)  # tokens still to feed
    answer: list[int] = field(default_factory=list)
    finish: str | None = None  # set once the row stops generating


def _logits(model: PreTrainedModel, h: torch.Tensor) -> torch.Tensor:
    return softcap_logits(model.get_output_embeddings()(h), logit_softcap(model))


class FeatureGenerator:
    """Greedy (or sampled) batched generation of a causal LM that returns each row's features
    (`aux_indices=None`: answers only, no hooks and no feature buffers)."""

    def __init__(self, model: PreTrainedModel, aux_indices: Sequence[int] | None, eos: set[int], pad_token_id: int,
                 max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, compact_fraction: float = 0.125):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model, self.indices = model, None if aux_indices is None else list(aux_indices)
        self.decoder = decoder_of(model)
        self.eos, self.pad, self.max_new_tokens = set(eos), int(pad_token_id), max_new_tokens
        self.sample = None
        if temperature > 0:
            from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

            warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)]
                                          + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
            # the temperature / top-p warpers never read input_ids
            self.sample = lambda logits: torch.multinomial(
                torch.softmax(warpers(None, logits.float()), -1), 1)[:, 0]  # type: ignore[arg-type]
        self.compact_fraction = compact_fraction
        self.num_layers = text_config(model).num_hidden_layers
        self.device = cast(torch.Tensor, model.get_input_embeddings().weight).device
        self._cache_kw = "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"

    def _next(self, logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        greedy = logits.argmax(-1)
        chosen = greedy if self.sample is None else self.sample(logits)
        return greedy, chosen.tolist()

    def _advance(self, row: _Row, token: int, tail: list[int]) -> None:
        """Take the token the model chose after the row's last input; queue the next input(s)."""
        if row.finish is None:
            if token in self.eos:
                row.finish, row.forced = "stop", list(tail)
            else:
                row.answer.append(token)
                row.forced = [token]
                if len(row.answer) >= self.max_new_tokens:
                    row.finish = "length"
                    row.forced += tail

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], tails: list[list[int]]) -> list[Generated]:
        """Each prompt's answer and features; `tails[i]` is fed after row i stops (see module docstring)."""
        b = len(prompts)
        if b == 0:
            return []
        if any(not p for p in prompts):
            raise ValueError("empty prompt")
        width = max(len(p) for p in prompts)
        capacity = width + self.max_new_tokens + max(len(t) for t in tails) + 1
        features = self.indices is not None
        indices: Sequence[int] = self.indices or []
        if features:
            h = text_config(self.model).hidden_size
            dtype = cast(torch.Tensor, self.decoder.get_input_embeddings().weight).dtype
            aux_buf = torch.empty(b, capacity, 3 * h, dtype=dtype, device=self.device)
            last_buf = torch.empty(b, capacity, h, dtype=dtype, device=self.device)
            greedy_buf = torch.empty(b, capacity, dtype=torch.long, device=self.device)
        ids = torch.full((b, width), self.pad, dtype=torch.long)
        mask = torch.zeros(b, capacity, dtype=torch.long)  # [B, width + steps]: left padding, then ones
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        mask[:, width:] = 1
        mask, ids = mask.to(self.device), ids.to(self.device)
        positions = (mask[:, :width].cumsum(-1) - 1).clamp_min(0)
        layers = [PreallocatedLayer(capacity) for _ in range(self.num_layers)]
        cache = Cache(layers=list(layers))
        kw = {self._cache_kw: cache}
        rows = [_Row(fed=list(p)) for p in prompts]
        hooks: AbstractContextManager[dict[int, torch.Tensor]] = (
            capture_layer_outputs(self.model, indices) if features else nullcontext({}))
        with prepacked_linears(self.model), hooks as captured:
            out = self.decoder(input_ids=ids, attention_mask=mask[:, :width], position_ids=positions,
                               use_cache=True, **kw)
            if features:
                real = mask[:, :width].bool()  # left padding is never computed past the decoder
                last = out.last_hidden_state[real]  # [N, H], row by row
                aux = aux_from(captured, indices)[real]  # [N, 3H]
                greedy = torch.cat([_logits(self.model, chunk).argmax(-1) for chunk in last.split(4096)])
                start = 0
                for i, p in enumerate(prompts):
                    n = len(p)
                    aux_buf[i, :n], last_buf[i, :n] = aux[start:start + n], last[start:start + n]
                    greedy_buf[i, :n] = greedy[start:start + n]
                    start += n
                del out, last, aux, greedy
                step_logits = _logits(self.model, last_buf[torch.arange(b), [len(p) - 1 for p in prompts]])
            else:  # left padding: every row's last prompt token sits in the last column
                step_logits = _logits(self.model, out.last_hidden_state[:, -1])
                del out
            _, chosen = self._next(step_logits)
            for row, tail, tok in zip(rows, tails, chosen):
                self._advance(row, tok, tail)
            active = list(range(b))  # cache row k holds prompt active[k]
            step = 0
            while active:
                finished = [k for k, i in enumerate(active) if not rows[i].forced]
                if len(finished) >= max(1, int(self.compact_fraction * len(active))) or len(finished) == len(active):
                    keep = [k for k in range(len(active)) if rows[active[k]].forced]
                    if not keep:
                        break
                    index = torch.tensor(keep, device=self.device)
                    for layer in layers:  # the cache's own layers
                        layer.batch_select_indices(index)
                    mask = mask[index]
                    active = [active[k] for k in keep]
                feeding = [bool(rows[i].forced) for i in active]
                tokens = [rows[i].forced.pop(0) if rows[i].forced else self.pad for i in active]
                where = [len(rows[i].fed) for i in active]
                for i, tok, go in zip(active, tokens, feeding):
                    if go:
                        rows[i].fed.append(tok)
                t = width + step
                inp = torch.tensor(tokens, device=self.device)[:, None]
                pos = torch.tensor(where, device=self.device)[:, None]
                out = self.decoder(input_ids=inp, attention_mask=mask[:, :t + 1], position_ids=pos, use_cache=True,
                                   **kw)
                step += 1
                last = out.last_hidden_state[:, 0]  # [B', H]
                greedy, chosen = self._next(_logits(self.model, last))
                if features:
                    aux = aux_from(captured, indices)[:, 0]
                    live = torch.tensor([k for k, go in enumerate(feeding) if go], device=self.device)
                    src_rows = torch.tensor([active[k] for k, go in enumerate(feeding) if go], device=self.device)
                    src_pos = torch.tensor([where[k] for k, go in enumerate(feeding) if go], device=self.device)
                    aux_buf[src_rows, src_pos] = aux[live]
                    last_buf[src_rows, src_pos] = last[live]
                    greedy_buf[src_rows, src_pos] = greedy[live]
                for k, i in enumerate(active):
                    if feeding[k]:
                        self._advance(rows[i], chosen[k], tails[i])
        results = []
        for i, row in enumerate(rows):
            n = len(row.fed)
            kept = (aux_buf[i, :n].clone(), last_buf[i, :n].clone(), greedy_buf[i, :n].clone()) if features else \
                (None, None, None)
            results.append(Generated(row.fed, row.answer, row.finish or "length", *kept))
        return results
