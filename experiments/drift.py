"""Drifted verifiers: the same model continued-trained on other text, the way its next version is made.

A public drafter is usually made for the *previous* version of a model: same architecture and tokenizer,
new weights. To measure what finetuning such a drafter buys, `build_drifted_verifiers` continues the
training of a verifier on other text (human chitchat dialogues, never the drafter's data nor MT-bench) and
saves it at several step counts, one drift strength each; `measure_drift` says how far each moved
(greedy agreement and KL against the original, cosine of the hidden states the drafter reads).

Checkpoints are cached like the embedded verifier (under `assets.cache_dir()`, one directory per recipe,
written atomically). The learning rate is constant after a fixed warmup, so the checkpoint at step s is
the same whichever longer trajectory produced it: a killed build re-runs only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3_hf.demo_data.prompts import chitchat_conversations
from eagle3_hf.verifier.capture import capture_layer_outputs
from eagle3_hf.verifier.family import check_aux_indices, default_aux_indices, text_config
from eagle3_hf.verifier.loading import cache_dir, load_tokenizer, load_verifier, resolve_verifier

RECIPE_FILE = "eagle3_drift.json"


@dataclass(frozen=True)
class DriftRecipe:
    """Continued training of every weight with AdamW; `steps` sets the drift strength (with `lr`)."""

    lr: float = 3e-4
    steps: int = 16
    warmup: int = 2
    seq_len: int = 128
    batch_size: int = 2
    weight_decay: float = 0.0
    seed: int = 0
    text: str = "chitchat[2000:]"  # the human dialogues of chitchat-dataset from conversation 2000 on

    def key(self, base: str) -> str:
        payload = json.dumps({"base": base, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


def drift_texts(start: int = 2000, limit: int | None = None) -> Iterable[list[dict]]:
    """Chitchat dialogues (human text on both sides): a distribution shift from the verifier's own answers.
    The default training prompts come from the first conversations, so starting at 2000 keeps them apart."""
    for i, conv in enumerate(chitchat_conversations()):
        if i < start:
            continue
        if limit is not None and i >= start + limit:
            return
        yield conv["messages"]


def token_blocks(tokenizer, conversations: Iterable[list[dict]], seq_len: int, num_blocks: int) -> torch.Tensor:
    """Chat-rendered conversations, concatenated and cut into [num_blocks, seq_len] training blocks."""
    stream: list[int] = []
    for messages in conversations:
        stream.extend(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
        if len(stream) >= seq_len * num_blocks:
            break
    if len(stream) < seq_len * num_blocks:
        raise ValueError(f"drift text has {len(stream)} tokens, {seq_len * num_blocks} needed")
    return torch.tensor(stream[: seq_len * num_blocks], dtype=torch.long).view(num_blocks, seq_len)


def drifted_dir(base: str, recipe: DriftRecipe) -> Path:
    return cache_dir() / f"{Path(resolve_verifier(base)).name}-drift-lr{recipe.lr:g}-s{recipe.steps}-{recipe.key(base)}"


def build_drifted_verifiers(base: str, steps: Sequence[int], recipe: DriftRecipe = DriftRecipe(),
                            blocks: torch.Tensor | None = None, log=print) -> dict[int, Path]:
    """Continue training `base` along one trajectory, saving it after each of `steps` optimizer steps.

    Cached checkpoints are reused; the trajectory runs only as far as the largest missing one. `blocks`
    ([N, seq_len] token ids) defaults to chitchat text rendered with the base's chat template.
    """
    recipes = {s: DriftRecipe(**{**asdict(recipe), "steps": int(s)}) for s in sorted(set(steps))}
    out = {s: drifted_dir(base, r) for s, r in recipes.items()}
    missing = [s for s, path in out.items() if not (path / RECIPE_FILE).is_file()]
    if not missing:
        return out
    tokenizer = load_tokenizer(base)
    if blocks is None:
        blocks = token_blocks(tokenizer, drift_texts(), recipe.seq_len, max(missing) * recipe.batch_size)
    model = load_verifier(base, dtype="float32")
    model.requires_grad_(True).train()
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay,
                                  betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, recipe.warmup)))
    order = torch.randperm(blocks.shape[0], generator=generator)
    for step in range(1, max(missing) + 1):
        idx = order[(torch.arange(recipe.batch_size) + (step - 1) * recipe.batch_size) % blocks.shape[0]]
        batch = blocks[idx]
        loss = model(input_ids=batch, labels=batch).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"drift training of {base}: loss is {loss.item()} at step {step} (lower lr)")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log(f"[drift] step {step}/{max(missing)} loss {loss.item():.3f}")
        if step in missing:
            _save(model, tokenizer, out[step], {"base": base, **asdict(recipes[step]), "final_loss": loss.item()})
    return out


def _save(model, tokenizer, path: Path, recipe: dict) -> None:
    """Write next to the final directory, then rename: a killed build never leaves a half-written cache."""
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    tmp.rename(path)


@torch.no_grad()
def _states(model, input_ids: torch.Tensor, aux_indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [T, V], aux states [T, 3H]) of one sequence."""
    with capture_layer_outputs(model, aux_indices) as captured:
        logits = model(input_ids=input_ids.view(1, -1), use_cache=False).logits[0].float()
    return torch.log_softmax(logits, -1), torch.stack([captured[i][0].float() for i in aux_indices])


@torch.no_grad()
def measure_drift(original, drifted, sequences: Iterable[torch.Tensor], aux_indices: Sequence[int] | None = None,
                  ) -> dict:
    """How far `drifted` moved from `original` on held-out token sequences, per token: greedy agreement,
    KL(original || drifted), and cosine of the hidden states at the drafter's aux layers."""
    num_layers = text_config(original).num_hidden_layers
    aux = check_aux_indices(list(aux_indices or default_aux_indices(num_layers)), num_layers)
    agree = kl = tokens = 0.0
    cos = torch.zeros(len(aux), dtype=torch.float64)
    for ids in sequences:
        ids = torch.as_tensor(ids, dtype=torch.long).view(-1)
        if ids.numel() == 0:
            continue
        lp, hp = _states(original, ids, aux)
        lq, hq = _states(drifted, ids, aux)
        agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        kl += (lp.exp() * (lp - lq)).sum(-1).sum().item()
        cos += torch.nn.functional.cosine_similarity(hp, hq, dim=-1).sum(-1).double()
        tokens += ids.numel()
    if not tokens:
        raise ValueError("measure_drift: no tokens in the held-out sequences")
    return {"tokens": int(tokens), "greedy_agreement": agree / tokens, "kl": kl / tokens,
            "aux_cosine": {str(i): c for i, c in zip(aux, (cos / tokens).tolist())},
            "aux_cosine_mean": float(cos.mean() / tokens)}


def weight_change(original, drifted) -> float:
    """Relative L2 change of all weights, ||W' - W|| / ||W||: the drift in parameter space."""
    num = den = 0.0
    theirs = dict(drifted.named_parameters())
    for name, p in original.named_parameters():
        num += (theirs[name].float() - p.float()).pow(2).sum().item()
        den += p.float().pow(2).sum().item()
    return math.sqrt(num / den)
