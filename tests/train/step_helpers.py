"""A tiny drafter in the real Eagle3Trainer, and packed batches for it: what the step tests share."""

from __future__ import annotations

import torch

from eagle3_hf.train.arguments import Eagle3TrainingArguments
from eagle3_hf.train.trainer import Eagle3Trainer

from tests.helpers.drafters import DRAFT_VOCAB, HIDDEN, VOCAB, tiny_model


def trainer_batch(row_len: int, documents: int, rows: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Packed rows of `documents` uneven documents with a padded tail, prompt tokens (loss_mask 0) at the start
    of each document and some greedy tokens outside the draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.full((rows, row_len), -1)
    pos = torch.zeros(rows, row_len, dtype=torch.long)
    loss_mask = torch.zeros(rows, row_len, dtype=torch.bool)
    for b in range(rows):
        cuts = torch.randint(8, max(9, row_len // documents), (documents,), generator=g)
        cuts = (cuts.float() * (row_len - 5) / cuts.sum()).long().clamp(min=4)
        start = 0
        for d, n in enumerate(cuts.tolist()):
            n = min(n, row_len - 3 - start)
            doc[b, start : start + n] = d
            pos[b, start : start + n] = torch.arange(n)
            loss_mask[b, start + n // 4 : start + n] = True
            start += n
    greedy = torch.randint(0, VOCAB, (rows, row_len), generator=g)
    greedy[greedy % 3 != 0] %= DRAFT_VOCAB  # 2/3 inside the draft vocabulary (identity mapping: ids < DRAFT_VOCAB)
    return {"input_ids": torch.randint(0, VOCAB, (rows, row_len), generator=g),
            "aux_hidden_states": torch.randn(rows, row_len, 3 * HIDDEN, generator=g),
            "last_hidden_state": torch.randn(rows, row_len, HIDDEN, generator=g),
            "verifier_greedy": greedy, "loss_mask": loss_mask, "position_ids": pos, "document_ids": doc}


def tiny_trainer(tmp_path, steps: int, **overrides) -> Eagle3Trainer:
    """The Trainer on a tiny drafter, with the accelerator's attention path (`packed_attention="row"`); an LK
    `objective` attaches the teacher with its in-vocabulary mass, as the training script does."""
    model = tiny_model()
    model.attach_teacher(torch.randn(VOCAB, HIDDEN) * 0.05,
                         in_vocab_mass=overrides.get("objective", "kl") != "kl")
    overrides.setdefault("packed_attention", "row")
    args = Eagle3TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none",
                                   ttt_steps=steps, disable_tqdm=True, **overrides)
    return Eagle3Trainer(model=model, args=args)
