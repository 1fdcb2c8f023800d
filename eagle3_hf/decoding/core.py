"""What every decoder here does the same way: the caches, one verifier forward with its aux states, one drafter
step, the tie margins, eos, sampling, and the two halves of a speculative cycle that do not depend on the shape
of the drafts (docs/contracts.md, "Metrics"):

- `prefill`: the verifier reads the prompt and gives the first token, as plain decoding does; the drafter reads
  (feature of t, token t + 1) for every prompt position.
- `Decoding.commit`: after a verify forward, the accepted drafts and the verifier's own token are emitted (cut at
  eos), the verifier's cache is rolled back to the accepted path and the drafter reads the verifier's features
  of it (as SGLang does).

chain.py drafts a chain between the two, tree.py a tree (`speculative_decode` in `__init__` picks one).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch

from ..verifier.capture import aux_from, capture_layer_outputs
from ..verifier.cpu_linear import prepacked_linears
from .result import SpeculativeResult

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel

    from ..model.modeling_eagle3 import Eagle3DraftModel

F = TypeVar("F", bound=Callable[..., Any])


# ---------------------------------------------------------------- the verifier's cache


def new_cache(verifier: PreTrainedModel) -> Cache:
    from transformers import DynamicCache

    return DynamicCache(config=verifier.config)


def make_rollbackable(cache: Cache) -> None:
    """Make sliding-window layers (Gemma 2/3, Mistral) keep the states a rejected draft pushed out of the
    window until `crop` runs. Called after the prefill, as `generate` does, so a long prompt is not kept whole."""
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()


def crop(cache: Cache, length: int) -> None:
    """Keep the first `length` positions (a negative crop removes tokens in every transformers 5.x). Always
    called, even with nothing to remove: crop(0) trims sliding-window layers back to their window."""
    cache.crop(-max(cache.get_seq_length() - length, 0))


def keep_rows(cache: Cache, tree_size: int, keep: Sequence[int]) -> None:
    """Keep, of the last `tree_size` rows of every layer, those at tree indices `keep` (the root and the
    accepted path): their keys/values are gathered out of each layer, nothing is recomputed. Sliding-window
    layers also move their position count back; `crop` then trims them to their window."""
    layer: Any  # DynamicLayer or DynamicSlidingWindowLayer: keys and values [B, heads, T, d]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or getattr(layer, "keys", None) is None:
            continue
        length = layer.keys.shape[-2]
        rows = torch.cat([torch.arange(length - tree_size), length - tree_size + torch.tensor(list(keep))])
        rows = rows.to(layer.keys.device)
        layer.keys, layer.values = layer.keys.index_select(-2, rows), layer.values.index_select(-2, rows)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length -= tree_size - len(keep)


# ---------------------------------------------------------------- one forward of each model


@functools.cache
def _parameters(forward: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` (a bound method) takes the keyword `name`; looked up once per function."""
    return name in _parameters(getattr(fn, "__func__", fn))


@overload
def verifier_forward(verifier: PreTrainedModel, ids: torch.Tensor, cache: Cache, aux_indices: None,
                     last_only: bool = ..., **model_kwargs: Any) -> tuple[torch.Tensor, None]: ...
@overload
def verifier_forward(verifier: PreTrainedModel, ids: torch.Tensor, cache: Cache, aux_indices: Sequence[int],
                     last_only: bool = ..., **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]: ...
def verifier_forward(verifier: PreTrainedModel, ids: torch.Tensor, cache: Cache, aux_indices: Sequence[int] | None,
                     last_only: bool = False, **model_kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [1, q] after `cache` -> (fp32 logits [q, V] or [1, V] with last_only, aux [1, q, 3 x H] or None).

    last_only computes the lm_head for the last position only (a prefill needs no other row). model_kwargs
    (a tree's attention_mask and position_ids, tree.py) go to the verifier as they are."""
    kwargs = {"cache" if accepts(verifier.forward, "cache") else "past_key_values": cache, **model_kwargs}
    if last_only and accepts(verifier.forward, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    if aux_indices is None:
        out, aux = verifier(input_ids=ids, use_cache=True, **kwargs), None
    else:
        with capture_layer_outputs(verifier, aux_indices) as captured:
            out = verifier(input_ids=ids, use_cache=True, **kwargs)
        # a verifier sharded by device_map leaves each layer's output on its own device: the drafter reads them
        # where the input ids are (the embedding's device, where `evaluate --device-map` puts the drafter)
        aux = aux_from({i: t.to(ids.device) for i, t in captured.items()}, aux_indices)  # [1, q, 3H]
    logits = out.logits[0]
    return (logits[-1:] if last_only else logits).float(), aux


def draft_step(drafter: Eagle3DraftModel, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               cache: Any, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """drafter.draft_step, with the draft lm_head over the last position only where that is all we read."""
    kwargs: dict[str, Any] = {}
    if last_only and accepts(drafter.draft_step, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    return drafter.draft_step(ids, hidden, positions, cache, **kwargs)


def prepacked(decode: F) -> F:
    """Run a decoder with every fp32 CPU Linear of its model arguments on prepacked oneDNN weights
    (cpu_linear.py): the same kernels for plain and speculative decoding, so the speedup stays honest."""
    @functools.wraps(decode)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with prepacked_linears(*args, *kwargs.values()):
            return decode(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------- tokens


def top2_margins(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 logit per row [q, V] -> q floats (the tie test of the lossless check)."""
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def eos_ids(verifier: PreTrainedModel, eos_token_id: int | Sequence[int] | None) -> set[int]:
    """None: the verifier's generation config (else config); an int or list overrides; [] disables."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(verifier, "generation_config", None), "eos_token_id", None)
        eos_token_id = verifier.config.eos_token_id if eos_token_id is None else eos_token_id
    eos_token_id = [] if eos_token_id is None else eos_token_id
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(i) for i in eos_token_id}


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sampling happens on CPU in fp64 so that a CPU generator seeds it identically on every device."""
    return torch.softmax(logits.detach().to("cpu", torch.float64) / temperature, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The verifier's own next token from its logits [V]: the argmax at temperature 0, else a sample."""
    return int(logits.argmax()) if temperature <= 0 else sample(probabilities(logits, temperature), generator)


# ---------------------------------------------------------------- a speculative decoder's state


@dataclass
class Decoding:
    """Both models' state between verify forwards, and what has been emitted and recorded so far."""

    drafter: Eagle3DraftModel
    device: torch.device  # the verifier's
    aux_indices: list[int]
    eos: set[int]
    max_new_tokens: int
    cache: Cache  # the verifier's: every token before `n`
    draft_logits: torch.Tensor  # [Vd]: the drafter's prediction of token n + 1 (the first draft)
    draft_hidden: torch.Tensor  # [1, 1, H]: its hidden state there, fed back with that draft
    draft_cache: Any  # the drafter's
    n: int  # index of the newest token, tokens[-1], which neither model has read yet
    tokens: list[int]
    margins: list[float]
    accepted: list[int] = field(default_factory=list)  # per verify forward, as SpeculativeResult
    drafted: list[int] = field(default_factory=list)
    proposals: list[list[int]] = field(default_factory=list)

    @property
    def last(self) -> int:
        return self.tokens[-1]

    def running(self) -> bool:
        return len(self.tokens) < self.max_new_tokens and self.last not in self.eos

    def budget(self, most: int) -> int:
        """Draft depth of the next cycle: `most`, fewer near max_new_tokens (no draft is wasted on tokens that
        would be cut)."""
        return min(most, self.max_new_tokens - len(self.tokens) - 1)

    def commit(self, path: list[int], bonus: int, rows: list[int], logits: torch.Tensor, aux: torch.Tensor,
               depth: int, proposals: list[int], tree_size: int | None = None) -> None:
        """Emit the accepted drafts `path` and the verifier's `bonus` token after them, and record the cycle.

        depth: the chain's length or the tree's depth; proposals: every draft token of the cycle. rows: the
        verify forward's rows of the last token and of the accepted path (its logits [q, V] and aux
        [1, q, 3H] are read there). Unless decoding ends here, the verifier keeps [.., last, path] (a tree's
        other rows are dropped first: tree_size), the bonus is left unread, and the drafter drops its
        draft-time entries and reads the verifier's features of [last, path] with the tokens after them."""
        accepted, new = len(path), path + [bonus]
        margins = top2_margins(logits[rows])
        stop = next((j for j, t in enumerate(new) if t in self.eos), None)
        if stop is not None:  # eos: nothing after it is emitted
            new, margins = new[: stop + 1], margins[: stop + 1]
            accepted = min(accepted, stop + 1)
        self.accepted.append(accepted)
        self.drafted.append(depth)
        self.proposals.append(proposals)
        self.tokens += new
        self.margins += margins
        if not self.running():
            return
        if tree_size is not None:
            keep_rows(self.cache, tree_size, rows)
        crop(self.cache, self.n + 1 + accepted)
        out = draft_step(self.drafter, torch.tensor([new], device=self.device), aux[:, rows],
                         torch.arange(self.n, self.n + accepted + 1, device=self.device)[None], self.draft_cache,
                         last_only=True)
        self.draft_logits, self.draft_hidden, self.draft_cache = out[0][0, -1], out[1][:, -1:], out[2]
        self.n += accepted + 1

    def result(self, start: float, **extra: Any) -> SpeculativeResult:
        """The decoder's record; `start` is its perf_counter at entry, extra the tree's own fields."""
        return SpeculativeResult(tokens=self.tokens, margins=self.margins, num_verifier_forwards=len(self.accepted),
                                 accepted_per_step=self.accepted, drafted_per_step=self.drafted,
                                 draft_tokens=self.proposals, seconds=time.perf_counter() - start, **extra)


def prefill(verifier: PreTrainedModel, drafter: Eagle3DraftModel, input_ids: Sequence[int] | torch.Tensor,
            max_new_tokens: int, temperature: float, generator: torch.Generator | None,
            eos_token_id: int | Sequence[int] | None) -> Decoding:
    """The verifier reads the prompt [P] and gives the first token; the drafter reads (feature of t, token t + 1)
    for t < P, which leaves its prediction of the token after that first one."""
    device = verifier.device
    if not drafter.config.aux_hidden_state_indices:
        raise ValueError("the drafter's config names no aux_hidden_state_indices: it cannot read the verifier")
    aux_indices = list(drafter.config.aux_hidden_state_indices)
    prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).view(1, -1)  # [1, P]
    n = prompt.shape[1]
    cache = new_cache(verifier)
    logits, aux = verifier_forward(verifier, prompt, cache, aux_indices, last_only=True)  # [1, V], [1, P, 3H]
    make_rollbackable(cache)
    first = pick(logits[-1], temperature, generator)
    next_ids = torch.cat([prompt[:, 1:], prompt.new_tensor([[first]])], dim=1)  # [1, P]
    d_logits, d_hidden, d_cache = draft_step(drafter, next_ids, aux, torch.arange(n, device=device)[None], None,
                                             last_only=True)
    return Decoding(drafter=drafter, device=device, aux_indices=aux_indices, eos=eos_ids(verifier, eos_token_id),
                    max_new_tokens=max_new_tokens, cache=cache, draft_logits=d_logits[0, -1],
                    draft_hidden=d_hidden[:, -1:], draft_cache=d_cache, n=n, tokens=[first],
                    margins=top2_margins(logits[-1:]))
