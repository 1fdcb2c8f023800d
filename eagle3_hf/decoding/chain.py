"""Speculative decoding with an EAGLE-3 drafter and a transformers verifier: the real acceptance length.

A drafter is measured the way an engine uses it (docs/contracts.md, "Metrics"): chain drafting of k
tokens verified by one verifier forward over [last, d_1 .. d_k], both models with KV caches cropped on
rejection, the drafter's cache then extended with the verifier's aux states of the accepted tokens (as
SGLang does). Reports τ (accepted drafts + the verifier's own token per verify forward, ≤ k + 1),
per-position acceptance, wall-clock speedup over plain decoding on the same machine, and the lossless check
(token-identical to plain greedy, except at numerical ties: top-2 fp32 logits within 1e-4, counted apart).
Temperature > 0 uses speculative sampling, exact in distribution; q is the drafter's draft-vocabulary
distribution placed on the verifier vocabulary through d2t (zero elsewhere).
The `eagle3-hf evaluate` command over a prompt set lives in evaluate.py.
"""

from __future__ import annotations

import functools
import inspect
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..verifier.family import text_config
from ..verifier.cpu_linear import prepacked_linears
from ..verifier.capture import aux_from, capture_layer_outputs

TIE_MARGIN = 1e-4  # docs/contracts.md "Metrics": top-2 fp32 logits closer than this are a numerical tie


def acceptance_metric_path() -> str:
    """Directory of the `evaluate` metric module, for `evaluate.load(acceptance_metric_path())`."""
    return str(Path(__file__).resolve().parents[1] / "evaluation" / "metrics" / "acceptance")


# ---------------------------------------------------------------- verifier plumbing


def _new_cache(verifier):
    from transformers import DynamicCache

    return DynamicCache(config=verifier.config)


def _rollbackable(cache) -> None:
    """Make sliding-window layers (Gemma 2/3, Mistral) keep the states a rejected draft pushed out of the
    window until `_crop` runs. Called after the prefill, as `generate` does, so a long prompt is not kept whole."""
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions (a negative crop removes tokens in every transformers 5.x). Always
    called, even with nothing to remove: crop(0) trims sliding-window layers back to their window."""
    cache.crop(-max(cache.get_seq_length() - length, 0))


@functools.lru_cache(maxsize=None)
def _parameters(forward) -> frozenset[str]:
    return frozenset(inspect.signature(forward).parameters)


def _accepts(fn, name: str) -> bool:
    """Whether `fn` (a bound method) takes the keyword `name`; looked up once per function."""
    return name in _parameters(getattr(fn, "__func__", fn))


def _verifier_forward(verifier, ids: torch.Tensor, cache, aux_indices: Sequence[int] | None, last_only: bool = False,
                      **model_kwargs):
    """ids [1, q] after `cache` -> (fp32 logits [q, V] or [1, V] with last_only, aux [1, q, 3 x H] or None).

    last_only computes the lm_head for the last position only (a prefill needs no other row). model_kwargs
    (a tree's attention_mask and position_ids, tree.py) go to the verifier as they are."""
    kwargs = {"cache" if _accepts(verifier.forward, "cache") else "past_key_values": cache, **model_kwargs}
    if last_only and _accepts(verifier.forward, "logits_to_keep"):
        kwargs["logits_to_keep"] = 1
    if aux_indices is None:
        out, aux = verifier(input_ids=ids, use_cache=True, **kwargs), None
    else:
        with capture_layer_outputs(verifier, aux_indices) as captured:
            out = verifier(input_ids=ids, use_cache=True, **kwargs)
        aux = aux_from(captured, aux_indices)  # [1, q, 3H]
    logits = out.logits[0]
    return (logits[-1:] if last_only else logits).float(), aux


def _draft_step(drafter, ids, hidden, positions, cache, last_only: bool = False):
    """drafter.draft_step, with the draft lm_head over the last position only where that is all we read."""
    kwargs = {"logits_to_keep": 1} if last_only and _accepts(drafter.draft_step, "logits_to_keep") else {}
    return drafter.draft_step(ids, hidden, positions, cache, **kwargs)


def _margins(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 logit per row [q, V] -> q floats (the tie test of the lossless check)."""
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def _eos_ids(verifier, eos_token_id) -> set[int]:
    """None: the verifier's generation config (else config); an int or list overrides; [] disables."""
    if eos_token_id is None:
        eos_token_id = getattr(getattr(verifier, "generation_config", None), "eos_token_id", None)
        eos_token_id = verifier.config.eos_token_id if eos_token_id is None else eos_token_id
    eos_token_id = [] if eos_token_id is None else eos_token_id
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(i) for i in eos_token_id}


def _sample(probs: torch.Tensor, generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sampling happens on CPU in fp64 so that a CPU generator seeds it identically on every device."""
    return torch.softmax(logits.detach().to("cpu", torch.float64) / temperature, dim=-1)


def _draft_distribution(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                        temperature: float) -> torch.Tensor:
    """Drafter logits [Vd] -> q over the verifier vocabulary [V] (zero outside the draft vocabulary).
    targets [Vd]: the verifier id of each draft id (d2t mapping, injective)."""
    q = torch.zeros(vocab_size, dtype=torch.float64)
    q[targets] = _probs(logits, temperature)
    return q


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int], generator=None) -> tuple[int, int]:
    """Speculative sampling over one chain. p [m+1, V] verifier probs, q [m, V] draft probs, m drafts.

    Returns (accepted, next_token): drafts[:accepted] are kept, then next_token is either the resample
    from norm(max(0, p - q)) at the first rejection or the bonus token from p[m]. Exact in distribution.
    """
    for i, x in enumerate(drafts):
        ratio = float(p[i, x] / q[i, x]) if q[i, x] > 0 else float("inf")
        if float(torch.rand((), dtype=torch.float64, generator=generator)) < min(1.0, ratio):
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        total = residual.sum()
        return i, _sample(residual / total if total > 0 else p[i], generator)
    return len(drafts), _sample(p[len(drafts)], generator)


# ---------------------------------------------------------------- decoding


def _prepacked(decode):
    """Run a decoder with every fp32 CPU Linear of its model arguments on prepacked oneDNN weights
    (cpu_linear.py): the same kernels for plain and speculative decoding, so the speedup stays honest."""
    @functools.wraps(decode)
    def wrapper(*args, **kwargs):
        with prepacked_linears(*args, *kwargs.values()):
            return decode(*args, **kwargs)
    return wrapper


@_prepacked
@torch.inference_mode()
def greedy_generate(verifier, input_ids, max_new_tokens: int, eos_token_id=None, temperature: float = 0.0,
                    generator: torch.Generator | None = None) -> dict[str, Any]:
    """Plain autoregressive decoding with a KV cache: the baseline for the lossless check and the speedup.

    Returns {"tokens", "margins" (top-2 logit gap per token), "num_verifier_forwards", "seconds"}.
    """
    start = time.perf_counter()
    eos = _eos_ids(verifier, eos_token_id)
    cache = _new_cache(verifier)
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=verifier.device).view(1, -1)  # [1, P]
    tokens, margins, forwards = [], [], 0
    while len(tokens) < max_new_tokens:
        last, _ = _verifier_forward(verifier, ids, cache, None, last_only=True)  # [1, V]
        forwards += 1
        margins += _margins(last)
        token = int(last.argmax()) if temperature <= 0 else _sample(_probs(last[0], temperature), generator)
        tokens.append(token)
        if token in eos:
            break
        ids = torch.tensor([[token]], device=verifier.device)
    return {"tokens": tokens, "margins": margins, "num_verifier_forwards": forwards,
            "seconds": time.perf_counter() - start}


@_prepacked
@torch.inference_mode()
def speculative_generate(verifier, drafter, input_ids, k: int = 3, max_new_tokens: int = 64,
                         temperature: float = 0.0, generator: torch.Generator | None = None,
                         eos_token_id=None) -> dict[str, Any]:
    """Chain speculative decoding (greedy at temperature 0, speculative sampling above).

    The prefill produces the first token as in plain decoding; every later verifier forward checks up to k
    drafts (fewer near max_new_tokens, so no draft is wasted on tokens that would be cut). Returns
    {"tokens", "num_verifier_forwards" (verify forwards, prefill excluded), "accepted_per_step",
    "drafted_per_step", "draft_tokens" (the proposals per step), "margins", "acceptance_length", "seconds"}.
    """
    start = time.perf_counter()
    device = verifier.device
    eos = _eos_ids(verifier, eos_token_id)
    aux_indices = list(drafter.config.aux_hidden_state_indices)
    greedy = temperature <= 0
    if not greedy:  # verifier id of every draft id, for q on the full vocabulary
        targets = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size, device=drafter.d2t.device))
        targets, vocab_size = targets.cpu(), int(drafter.config.vocab_size)
    prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).view(1, -1)  # [1, P]
    n = prompt.shape[1]  # index of the newest token, which neither model has read yet

    # prefill: the verifier reads the prompt; the drafter reads (feature of t, token t+1) for t < P
    cache = _new_cache(verifier)
    logits, aux = _verifier_forward(verifier, prompt, cache, aux_indices, last_only=True)  # [1, V], [1, P, 3H]
    _rollbackable(cache)
    margins = _margins(logits[-1:])
    last = int(logits[-1].argmax()) if greedy else _sample(_probs(logits[-1], temperature), generator)
    tokens = [last]
    next_ids = torch.cat([prompt[:, 1:], prompt.new_tensor([[last]])], dim=1)  # [1, P]
    d_logits, d_hidden, d_cache = _draft_step(drafter, next_ids, aux, torch.arange(n, device=device)[None], None, True)
    d_logits, d_hidden = d_logits[0, -1], d_hidden[:, -1:]  # [Vd] predicts token n+1; [1, 1, H]

    accepted_steps, drafted_steps, draft_tokens = [], [], []  # per verify forward
    while len(tokens) < max_new_tokens and last not in eos:
        chain = min(k, max_new_tokens - len(tokens) - 1)
        drafts, qs = [], []  # verifier ids; q over the verifier vocabulary (sampling)
        logits_i, hidden_i, cache_i = d_logits, d_hidden, d_cache
        for i in range(chain):  # the i-th draft (0-based) sits at token index n + 1 + i
            if greedy:
                drafts.append(int(drafter.draft_to_target(logits_i.argmax())))
            else:
                q = _draft_distribution(logits_i, targets, vocab_size, temperature)
                qs.append(q)
                drafts.append(_sample(q, generator))
            if i + 1 < chain:  # feed the draft back with the drafter's own hidden state, RoPE position n + i
                step = drafter.draft_step(torch.tensor([[drafts[-1]]], device=device), hidden_i,
                                          torch.tensor([[n + i]], device=device), cache_i)
                logits_i, hidden_i, cache_i = step[0][0, -1], step[1], step[2]

        # verify: one forward over [last, d_1 .. d_m] at positions n .. n + m
        ids = torch.tensor([[last] + drafts], device=device)
        v_logits, v_aux = _verifier_forward(verifier, ids, cache, aux_indices)  # [m+1, V], [1, m+1, 3H]
        if greedy:
            choice = v_logits.argmax(-1).tolist()
            accepted = 0
            while accepted < chain and drafts[accepted] == choice[accepted]:
                accepted += 1
            bonus = choice[accepted]
        else:
            p = _probs(v_logits, temperature)
            accepted, bonus = verify_sampled(p, torch.stack(qs) if qs else p[:0], drafts, generator)
        new = drafts[:accepted] + [bonus]
        step_margins = _margins(v_logits[: accepted + 1])
        stop = next((j for j, t in enumerate(new) if t in eos), None)
        if stop is not None:  # eos: nothing after it is emitted
            new, step_margins = new[: stop + 1], step_margins[: stop + 1]
            accepted = min(accepted, stop + 1)
        accepted_steps.append(accepted)
        drafted_steps.append(chain)
        draft_tokens.append(drafts)
        tokens, margins, last = tokens + new, margins + step_margins, new[-1]
        if stop is not None or len(tokens) >= max_new_tokens:
            break
        _crop(cache, n + 1 + accepted)  # the verifier keeps [.., last, d_1 .. d_a]; the bonus is unread
        # the drafter drops its draft-time entries and reads the verifier's features of the accepted tokens
        d_out = _draft_step(drafter, torch.tensor([new], device=device), v_aux[:, : accepted + 1],
                            torch.arange(n, n + accepted + 1, device=device)[None], d_cache, last_only=True)
        d_logits, d_hidden, d_cache = d_out[0][0, -1], d_out[1][:, -1:], d_out[2]
        n += accepted + 1

    steps = len(accepted_steps)
    return {"tokens": tokens, "margins": margins, "num_verifier_forwards": steps, "accepted_per_step": accepted_steps,
            "drafted_per_step": drafted_steps, "draft_tokens": draft_tokens,
            "acceptance_length": (sum(accepted_steps) + steps) / steps if steps else None,
            "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------- statistics and the lossless check


def acceptance_stats(accepted: Sequence[int], drafted: Sequence[int], k: int | None = None) -> dict[str, Any]:
    """τ, per-position acceptance and histogram from per-verify-step records (same as the metric module).

    τ = mean(accepted + 1). Position j's acceptance is unconditional: the share of steps that drafted at
    least j tokens in which the first j were all accepted.
    """
    k = int(k if k is not None else max(drafted, default=0))
    steps, per_position = len(accepted), []
    for j in range(1, k + 1):
        offered = sum(1 for d in drafted if d >= j)
        hits = sum(1 for a, d in zip(accepted, drafted) if d >= j and a >= j)
        per_position.append(hits / offered if offered else None)
    histogram = [list(accepted).count(j) for j in range(k + 1)]
    return {
        "acceptance_length": (sum(accepted) + steps) / steps if steps else None,
        "per_position_acceptance": per_position,
        "accepted_histogram": histogram,
        "num_steps": steps,
    }


def compare_to_greedy(tokens: Sequence[int], margins: Sequence[float], ref_tokens: Sequence[int],
                      ref_margins: Sequence[float], tie_margin: float = TIE_MARGIN) -> tuple[str, int | None]:
    """-> ("match" | "tie" | "mismatch", first differing index). A divergence where either run saw the
    verifier's top-2 logits within `tie_margin` is a numerical tie; the rest of that sample is not compared."""
    for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
        if a != b:
            return ("tie" if min(margins[i], ref_margins[i]) < tie_margin else "mismatch"), i
    if len(tokens) != len(ref_tokens):
        return "mismatch", min(len(tokens), len(ref_tokens))
    return "match", None


# ---------------------------------------------------------------- does the drafter fit the verifier


def check_pair(verifier, drafter, tokenizer=None) -> list[str]:
    """Refuse a drafter whose shapes cannot fit this verifier; return warnings for softer mismatches."""
    vcfg, dcfg = text_config(verifier), drafter.config
    layers, aux = int(vcfg.num_hidden_layers), list(dcfg.aux_hidden_state_indices or [])
    problems = [f"drafter {key} {getattr(dcfg, key)} != verifier {vkey} {getattr(vcfg, vkey)}"
                for key, vkey in (("target_hidden_size", "hidden_size"), ("vocab_size", "vocab_size"))
                if int(getattr(dcfg, key)) != int(getattr(vcfg, vkey))]
    if len(aux) != 3 or any(not 1 <= int(i) <= layers - 1 for i in aux):
        problems.append(f"aux_hidden_state_indices {aux} need three indices in 1..{layers - 1} for this verifier")
    if problems:
        built_for = f" (the drafter was built for {dcfg.verifier_name_or_path})" if dcfg.verifier_name_or_path else ""
        raise ValueError(f"drafter and verifier do not fit{built_for}: " + "; ".join(problems))
    warnings = []
    if dcfg.verifier_num_hidden_layers and int(dcfg.verifier_num_hidden_layers) != layers:
        warnings.append(f"drafter was trained for a {dcfg.verifier_num_hidden_layers}-layer verifier, this one has {layers}")
    if tokenizer is not None and getattr(dcfg, "tokenizer_fingerprint", None):
        from ..data.fingerprint import tokenizer_fingerprint

        if tokenizer_fingerprint(tokenizer) != dcfg.tokenizer_fingerprint:
            warnings.append("drafter was trained with a different tokenizer (fingerprint mismatch)")
    return warnings
