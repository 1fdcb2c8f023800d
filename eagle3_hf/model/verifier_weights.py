"""What the drafter takes from its verifier and how its draft vocabulary maps onto the verifier's: the d2t / t2d
buffers (install, switch with the lm_head rows carried over), the verifier's raw input embedding (as both engines
read it), and the frozen teacher head (the verifier's lm_head rows on the draft vocabulary) with its softmax (and,
for the acceptance losses, the verifier's mass on the draft vocabulary).

A mixin of `Eagle3DraftModel` (modeling_eagle3.py), kept apart so that the model's file reads as the network and
its checkpoints, and this one as the contract with the verifier's weights. Every method is the model's own public
API (`model.load_verifier_embeddings(verifier)`, ...); nothing here is saved that the checkpoint does not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..verifier.family import logit_softcap as verifier_logit_softcap
from ..verifier.family import softcap_logits
from .checkpoint import draft_to_target, target_to_draft, validate_vocab_mapping
from .configuration_eagle3 import Eagle3Config  # at run time: transformers reads the class's annotations

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Eagle3VerifierWeights(nn.Module):
    """The vocabulary mapping and the verifier's weights of `Eagle3DraftModel`, which builds every attribute below."""

    config: Eagle3Config
    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    d2t: torch.Tensor  # [Vd] offsets: target id = i + d2t[i]
    t2d: torch.Tensor  # [V] bool: the verifier's tokens in the draft vocabulary
    embed_tokens_loaded: bool
    verifier_lm_head: nn.Linear | None
    verifier_lm_head_rest: nn.Linear | None  # the verifier's other rows, with attach_teacher(in_vocab_mass=True)
    teacher_in_vocab_mass: bool
    teacher_logit_softcap: float | None

    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install a draft vocabulary (from eagle3_hf.data.vocab), checking it is self-consistent."""
        validate_vocab_mapping(d2t, t2d, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.copy_(d2t.to(torch.long))
        self.t2d.copy_(t2d.to(torch.bool))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> verifier ids (d2t holds offsets)."""
        return draft_to_target(self.d2t, draft_ids)

    def remap_lm_head(self, d2t: torch.Tensor, t2d: torch.Tensor) -> int:
        """Switch to another draft vocabulary, moving each lm_head row to its token's new index (tokens this
        drafter never drafted get a fresh row), so a finetune can use the dataset's vocabulary. Returns how many
        rows carried over."""
        new_targets = draft_to_target(d2t)
        old_rows = target_to_draft(self.d2t.cpu(), new_targets).tolist()
        old_weight = self.lm_head.weight.detach().clone()
        new_head = nn.Linear(old_weight.shape[1], len(old_rows), bias=False, dtype=old_weight.dtype)
        nn.init.normal_(new_head.weight, std=self.config.initializer_range)
        carried = 0
        with torch.no_grad():
            for j, row in enumerate(old_rows):
                if row >= 0:
                    new_head.weight[j] = old_weight[row]
                    carried += 1
        self.lm_head = new_head
        self.config.draft_vocab_size = len(old_rows)
        self.register_buffer("d2t", torch.zeros(len(old_rows), dtype=torch.long))
        self.set_vocab_mapping(d2t, t2d)
        return carried

    def load_verifier_embeddings(self, verifier: PreTrainedModel | torch.Tensor) -> None:
        """Copy the verifier's input embedding (a model or its [V, H] weight), as the engines do at serving.

        The drafter looks tokens up in the verifier's raw `embed_tokens.weight`, never through the
        verifier's embedding forward: Gemma's sqrt(hidden_size) scale is NOT applied. This matches both
        engines: vLLM's `load_eagle_model` shares the target's `embed_tokens` module, whose forward is a plain
        `VocabParallelEmbedding` lookup (its Gemma 3 applies the normalizer outside it, in
        `embed_input_ids`), and `llama_eagle3.py` embeds with `self.embed_tokens(input_ids)`; SGLang copies
        the target's embedding *weight* into the drafter's own `VocabParallelEmbedding` (`set_embed`).
        `train` reads the same raw tensor by name (`verifier_io_weights`). The drafter's `input_layernorm`
        follows, so a constant scale would barely matter anyway (RMSNorm is scale-invariant up to eps).
        """
        if isinstance(verifier, torch.Tensor):
            weight = verifier
        else:  # raw, unscaled; transformers types get_input_embeddings() as a plain nn.Module
            weight = cast(torch.Tensor, verifier.get_input_embeddings().weight)
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"verifier embedding {tuple(weight.shape)} does not fit the drafter's "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab_size x hidden_size)"
            )
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.to(self.embed_tokens.weight.dtype))
        self.embed_tokens_loaded = True

    def attach_teacher(self, verifier: PreTrainedModel | torch.Tensor, logit_softcap: float | None = None,
                       in_vocab_mass: bool = False) -> None:
        """Keep the verifier's lm_head rows for the draft vocabulary (frozen): the teacher distribution is
        lm_head(h_last) restricted to the draft vocabulary — never full-vocabulary logits. Attach after the
        vocabulary mapping is final. Never saved (not part of the checkpoint contract).

        `in_vocab_mass` (the acceptance losses, train/objective.py): also keep the other rows of the verifier's
        head, so that the teacher can say how much of the verifier's distribution the draft vocabulary holds
        (its full-vocabulary log-sum-exp, a block of rows at a time); nothing more is kept when the draft
        vocabulary is the whole head."""
        if isinstance(verifier, torch.Tensor):
            weight = verifier  # [V, H]
        else:
            weight = verifier.get_output_embeddings().weight
            logit_softcap = logit_softcap or verifier_logit_softcap(verifier)
        if weight.shape[0] < self.config.vocab_size or weight.shape[1] != self.config.target_hidden_size:
            raise ValueError(f"verifier lm_head {tuple(weight.shape)} does not match vocab_size "
                             f"{self.config.vocab_size} x target_hidden_size {self.config.target_hidden_size}")
        targets = draft_to_target(self.d2t)
        self.verifier_lm_head = self._frozen_rows(weight.detach()[targets.to(weight.device)])  # [Vd, H]
        self.verifier_lm_head_rest = None
        if in_vocab_mass:
            # every row of the verifier's head outside the draft vocabulary (padding rows past vocab_size too:
            # the verifier's softmax spans them)
            outside = torch.ones(weight.shape[0], dtype=torch.bool, device=weight.device)
            outside[targets.to(weight.device)] = False
            if bool(outside.any()):
                self.verifier_lm_head_rest = self._frozen_rows(weight.detach()[outside])  # [V - Vd, H]
        self.teacher_in_vocab_mass = in_vocab_mass
        self.teacher_logit_softcap = logit_softcap

    def _frozen_rows(self, rows: torch.Tensor) -> nn.Linear:
        head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=self.lm_head.weight.device,
                         dtype=self.lm_head.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(rows)
        head.requires_grad_(False)
        return head

    def init_lm_head_from_verifier(self) -> None:
        """lm_head rows = the verifier's lm_head rows for the draft vocabulary, in d2t order (its embedding rows
        when it ties them): the teacher's own rows (`attach_teacher` first), so step 0 starts from the
        verifier's distribution restricted to the draft vocabulary."""
        if self.verifier_lm_head is None:
            raise RuntimeError("init_lm_head_from_verifier needs the verifier's rows: call attach_teacher first")
        if self.config.hidden_size != self.config.target_hidden_size:
            raise ValueError(f"the verifier's lm_head rows have size {self.config.target_hidden_size}, this drafter's "
                             f"lm_head {self.config.hidden_size}: initialise it at random instead")
        with torch.no_grad():
            self.lm_head.weight.copy_(self.verifier_lm_head.weight.to(self.lm_head.weight.dtype))

    def freeze_lm_head(self, frozen: bool = True) -> None:
        """Train without lm_head (as speculators does): no gradient for it, so the optimizer holds no state for
        it and its backward skips the weight gradient (the largest matmul of the step)."""
        self.lm_head.weight.requires_grad_(not frozen)

    def _check_embeddings(self) -> None:
        if not self.embed_tokens_loaded:
            raise RuntimeError(
                "this drafter's checkpoint has no embed_tokens (engines share the verifier's); call "
                "model.load_verifier_embeddings(verifier) or pass verifier=... to from_pretrained first"
            )

    @torch.no_grad()
    def teacher_distribution(self, last_hidden_state: torch.Tensor) -> torch.Tensor:
        """softmax(verifier lm_head(h_last)) over the draft vocabulary, fp32 [.., Vd]: computed once per batch;
        step i's teacher at t is this at t + 1 + i (the loss indexes it, nothing is copied per step). The
        softmax runs in place, a block of rows at a time, so the logits and probabilities share one tensor."""
        return self._teacher(last_hidden_state, with_mass=False)[0]

    @torch.no_grad()
    def teacher_distribution_and_mass(self, last_hidden_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`teacher_distribution`, the verifier's probability mass on the draft vocabulary [..], fp32): the mass is
        exp(logsumexp over the draft rows - logsumexp over every row), the rows outside the draft vocabulary
        (`attach_teacher(..., in_vocab_mass=True)`) formed a block of positions at a time; 1 where the draft
        vocabulary is the whole head."""
        if not self.teacher_in_vocab_mass:
            raise RuntimeError("the teacher's in-vocabulary mass needs attach_teacher(verifier, in_vocab_mass=True)")
        probs, mass = self._teacher(last_hidden_state, with_mass=True)
        assert mass is not None  # with_mass
        return probs, mass

    def _teacher(self, last_hidden_state: torch.Tensor, with_mass: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        head = self.verifier_lm_head
        if head is None:
            raise RuntimeError("teacher_distribution needs the verifier's rows: call attach_teacher first")
        probs = head(last_hidden_state.to(head.weight.dtype)).float()
        flat = probs.view(-1, probs.shape[-1])
        block = max(1, (1 << 23) // flat.shape[1])
        rest = self.verifier_lm_head_rest if with_mass else None
        mass = flat.new_ones(flat.shape[0]) if with_mass else None
        hidden = last_hidden_state.reshape(-1, last_hidden_state.shape[-1])
        if rest is not None:  # the other rows' logits exist a block at a time, never all at once (out_features: under
            # ZeRO-3 the weight itself is a partitioned placeholder outside the module's call)
            block = min(block, max(1, (1 << 23) // rest.out_features))
        for start in range(0, flat.shape[0], block):
            rows = softcap_logits(flat[start : start + block], self.teacher_logit_softcap)
            if rest is not None and mass is not None:
                other = rest(hidden[start : start + block].to(rest.weight.dtype)).float()
                draft_lse = rows.logsumexp(-1)
                other_lse = softcap_logits(other, self.teacher_logit_softcap).logsumexp(-1)
                mass[start : start + block] = torch.exp(draft_lse - torch.logaddexp(draft_lse, other_lse))
            flat[start : start + block] = torch.softmax(rows, dim=-1)
        return probs, None if mass is None else mass.view(probs.shape[:-1])
