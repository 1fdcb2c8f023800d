"""Does a drafter (or features) built for one verifier fit this one: the one rule, written once.

What a drafter records of the verifier it was built for (its config: target_hidden_size, vocab_size,
aux_hidden_state_indices, verifier_num_hidden_layers, tokenizer_fingerprint) is compared with the verifier at
hand. Sizes and aux layers that do not fit are errors: decoding would fail, or read other features. Another
layer count or tokenizer is a warning: it runs, and acceptance is what measures it. `evaluate` refuses a misfit
(`require_fit`), `check` reports the sizes as findings, training refuses features of another width.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .family import aux_indices_problem, text_config


@dataclass(frozen=True)
class Misfit:
    key: str  # the drafter config key that does not fit
    value: Any  # the drafter's
    expected: Any  # what this verifier needs
    message: str  # one line naming the key
    error: bool = True  # False: a warning

    def __str__(self) -> str:
        return self.message


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def misfits(verifier: Any, *, target_hidden_size: int | None = None, vocab_size: int | None = None,
            aux_hidden_state_indices: list[int] | None = None, verifier_num_hidden_layers: int | None = None,
            tokenizer_fingerprint: str | None = None, verifier_tokenizer_fingerprint: str | None = None,
            what: str = "drafter") -> list[Misfit]:
    """Each recorded value (None: not recorded, not compared) against `verifier` (a model, a config or a
    config.json dict; its text config is read); the tokenizer fingerprint against the verifier tokenizer's,
    when both are known. `what` names the side that was built for a verifier in the messages."""
    vcfg = text_config(verifier)
    hidden, vocab, layers = (_get(vcfg, key) for key in ("hidden_size", "vocab_size", "num_hidden_layers"))
    found = []
    for key, value, vkey, expected in (("target_hidden_size", target_hidden_size, "hidden_size", hidden),
                                       ("vocab_size", vocab_size, "vocab_size", vocab)):
        if value is not None and expected is not None and value != expected:
            found.append(Misfit(key, value, expected, f"{what} {key} {value} != verifier {vkey} {expected}"))
    if aux_hidden_state_indices is not None:
        problem = aux_indices_problem(aux_hidden_state_indices, int(layers) if layers else None)
        if problem:
            found.append(Misfit("aux_hidden_state_indices", list(aux_hidden_state_indices), layers,
                                f"{what} aux_hidden_state_indices: {problem[1]}"))
    if verifier_num_hidden_layers and layers and int(verifier_num_hidden_layers) != int(layers):
        found.append(Misfit("verifier_num_hidden_layers", verifier_num_hidden_layers, layers,
                            f"{what} was trained for a {verifier_num_hidden_layers}-layer verifier, this one has "
                            f"{layers}", error=False))
    if verifier_tokenizer_fingerprint and tokenizer_fingerprint not in (None, "", verifier_tokenizer_fingerprint):
        found.append(Misfit("tokenizer_fingerprint", tokenizer_fingerprint, verifier_tokenizer_fingerprint,
                            f"{what} was trained with a different tokenizer (tokenizer_fingerprint mismatch)",
                            error=False))
    return found


def drafter_misfits(drafter_config: Any, verifier: Any,
                    verifier_tokenizer_fingerprint: str | None = None) -> list[Misfit]:
    """`misfits` of a drafter config (an Eagle3Config or a config.json dict; target_hidden_size defaults to
    hidden_size, as the engines read it)."""
    return misfits(verifier, target_hidden_size=_get(drafter_config, "target_hidden_size") or _get(
                       drafter_config, "hidden_size"),
                   vocab_size=_get(drafter_config, "vocab_size"),
                   aux_hidden_state_indices=_get(drafter_config, "aux_hidden_state_indices"),
                   verifier_num_hidden_layers=_get(drafter_config, "verifier_num_hidden_layers"),
                   tokenizer_fingerprint=_get(drafter_config, "tokenizer_fingerprint"),
                   verifier_tokenizer_fingerprint=verifier_tokenizer_fingerprint)


def require_fit(drafter_config: Any, verifier: Any, verifier_tokenizer_fingerprint: str | None = None) -> list[str]:
    """Refuse a drafter that cannot fit this verifier (a ValueError naming every misfit, one line); return the
    warnings' messages."""
    found = drafter_misfits(drafter_config, verifier, verifier_tokenizer_fingerprint)
    errors = [m.message for m in found if m.error]
    if errors:
        name = _get(drafter_config, "verifier_name_or_path")
        built_for = f" (the drafter was built for {name})" if name else ""
        raise ValueError(f"drafter and verifier do not fit{built_for}: " + "; ".join(errors))
    return [m.message for m in found if not m.error]
