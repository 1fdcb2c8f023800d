"""Eagle3DraftModel: the EAGLE-3 drafter as a transformers PreTrainedModel.

Reads top to bottom in the order data flows: features -> fc -> the one decoder layer ("midlayer", whose
attention sees cat(embedding, hidden)) -> norm -> lm_head over the draft vocabulary. Two entry points:

- `forward`: the training-time-test (TTT) unroll over a *packed* batch (several documents per row), as
  docs/contracts.md defines it: at step i every position reads the token i places later in its document, feeds
  back its own step i-1 output, attends causally to step-0 keys of its own document plus its own keys of
  steps 1..i (the diagonal), at RoPE position t + i. Attention runs per document, so no compute is spent
  on blocks the mask would throw away.
- `draft_step`: one incremental step with a KV cache, as an engine runs the drafter (decoding/).

The layer itself is decoder_layer.py, attention over packed documents ttt_attention.py, the vocabulary mapping
and the verifier's weights (embedding, teacher head) verifier_weights.py, a mixin of the model; checkpoints are
the standard layout SGLang and vLLM load (see `eagle3_hf/model/checkpoint.py`). This file keeps the network's
wiring, its two entry points and the checkpoint I/O transformers users call on the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils import ModelOutput

from .checkpoint import EMBED_KEY, read_drafter_checkpoint, standard_state_dict, write_speculators
from .configuration_eagle3 import Eagle3Config
from .decoder_layer import Eagle3DecoderLayer
from .head_rows import HeadRows, gather_rows
from .ttt_attention import DraftKeys, packed_keys, shift_within_documents
from .verifier_weights import Eagle3VerifierWeights


@dataclass
class Eagle3Output(ModelOutput):
    """Per TTT step: draft-vocabulary logits [B, L, Vd], the layer outputs [B, L, H] the next step feeds back
    (pre-norm; post-norm with the config's `norm_output`) and which positions exist at that step (their input
    token lies in the document).

    When the forward was given `logits_mask` / `teacher_mask`, step i's logits are the rows [N_i, Vd] at
    `logits_mask[i]` and the teacher's the rows [M, Vd] at `teacher_mask`, in row-major order."""

    logits: tuple[torch.Tensor, ...] | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    step_valid: tuple[torch.Tensor, ...] | None = None
    teacher_probs: torch.Tensor | None = None  # [B, L, Vd] fp32: the verifier's distribution on the draft vocabulary
    teacher_in_vocab_mass: torch.Tensor | None = None  # [B, L] fp32 (or [M]): its mass there before renormalising
    logits_mask: tuple[torch.Tensor, ...] | None = None
    teacher_mask: torch.Tensor | None = None


class Eagle3PreTrainedModel(PreTrainedModel):
    config_class = Eagle3Config
    config: Eagle3Config
    base_model_prefix = ""
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _no_split_modules = ["Eagle3DecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear, Embedding, RMSNorm, rotary buffers as in every HF model
        if isinstance(module, Eagle3DraftModel):  # identity mapping until a real vocabulary is installed
            module.d2t.zero_()
            module.t2d.zero_()
            module.t2d[: module.config.draft_vocab_size] = True


class Eagle3DraftModel(Eagle3PreTrainedModel, Eagle3VerifierWeights):
    """EAGLE-3 drafter. Buffers `d2t` (offsets: target id = i + d2t[i]) and `t2d` (mask over the verifier
    vocabulary) are saved with the weights; `embed_tokens` is the verifier's, frozen, and only saved on
    request (engines take the verifier's own)."""

    source_layout: str  # "standard" or "speculators": set by from_pretrained
    # the TTT unroll's attention (ttt_attention.packed_keys): "auto" = per document on a CPU, one call per step
    # over the batch elsewhere; not part of the checkpoint
    packed_attention: str = "auto"
    drafter_kind = "eagle3"  # its row in engines/table.py: how it is trained, served and checked

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        hidden = config.hidden_size
        target_hidden = config.target_hidden_size
        assert target_hidden is not None  # Eagle3Config.__post_init__ defaults it to hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.embed_tokens.weight.requires_grad_(False)
        # EAGLE 3.1 options on the fc input (config docstring): one norm over [.., 3 x T], or one per aux state [.., T]
        self.input_norm = LlamaRMSNorm(3 * target_hidden, eps=config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = (nn.ModuleList(LlamaRMSNorm(target_hidden, eps=config.rms_norm_eps) for _ in range(3))
                        if config.fc_norm else None)
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.d2t: torch.Tensor  # the buffers, declared for type checkers
        self.t2d: torch.Tensor
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.embed_tokens_loaded = True  # set False by from_pretrained when the checkpoint had none
        self.verifier_lm_head: nn.Linear | None = None  # frozen teacher rows, attached for training only
        self.verifier_lm_head_rest: nn.Linear | None = None  # the other rows (attach_teacher(in_vocab_mass=True))
        self.teacher_in_vocab_mass = False
        self.teacher_logit_softcap: float | None = None
        self.post_init()

    # ------------------------------------------------------------------ training: the TTT unroll

    def project_features(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """Verifier features [.., 3 x target_hidden] -> drafter hidden [.., H]; drafter states pass as is."""
        target_hidden = self.config.target_hidden_size
        assert target_hidden is not None  # Eagle3Config.__post_init__ defaults it to hidden_size
        expected = 3 * target_hidden
        if aux_hidden_states.shape[-1] == expected:
            features = aux_hidden_states.to(self.fc.weight.dtype)  # [.., 3T]
            if self.input_norm is not None:  # norm_before_fc: one norm over the concatenation
                features = self.input_norm(features)
            if self.fc_norm is not None:  # fc_norm: one norm per aux state, in aux order
                chunks = features.chunk(len(self.fc_norm), dim=-1)  # 3 x [.., T]
                features = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
            return self.fc(features)
        if aux_hidden_states.shape[-1] == self.config.hidden_size:
            return aux_hidden_states
        raise ValueError(
            f"features have size {aux_hidden_states.shape[-1]}; this drafter expects 3 x target_hidden_size = "
            f"{expected} (verifier aux states) or hidden_size = {self.config.hidden_size}"
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden_states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        ttt_steps: int | None = None,
        last_hidden_state: torch.Tensor | None = None,
        logits_mask: tuple[torch.Tensor, ...] | None = None,
        teacher_mask: torch.Tensor | None = None,
        head_rows: HeadRows | None = None,
    ) -> Eagle3Output:
        """TTT unroll over packed rows.

        input_ids [B, L], aux_hidden_states [B, L, 3 x target_hidden] aligned per position (feature of token t
        sits at t); position_ids [B, L] restart at 0 per document; document_ids [B, L] (-1 = padding). Step i's
        output at t predicts token t + 2 + i; `step_valid[i]` marks where token t + 1 + i is in t's document.
        With `last_hidden_state` [B, L, H] (the verifier's, post-norm) and a teacher attached, also returns the
        teacher distribution — computed here so that ZeRO-3 gathers the frozen head like any other weight.
        `logits_mask` (per step, [B, L] bool) and `teacher_mask` ([B, L] bool) restrict both heads, the largest
        matmuls of the step, to the positions the loss and the metrics read (see `Eagle3Output`); the MLP then
        runs only where step i or a later one reads the output (a position's step-i output feeds only its own
        later steps; the keys every position attends to are step 0's, computed before any MLP), so
        `hidden_states` elsewhere lack the MLP term. `head_rows` gives the same selection as row indices whose
        counts the host knows (no host synchronisation); given masks alone, the counts are read once here.

        Attention: `packed_attention` ("auto", "row" or "document", see `ttt_attention.packed_keys`) chooses
        one call per step over the whole batch (the accelerator path) or one per document.
        """
        self._check_embeddings()
        steps = int(ttt_steps or self.config.ttt_steps)
        batch, length = input_ids.shape
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        if head_rows is None and logits_mask is not None:
            head_rows = HeadRows.from_masks(logits_mask, teacher_mask)

        hidden = self.project_features(aux_hidden_states)  # [B, L, H]
        # grows by one step's keys per step
        keys = packed_keys(document_ids, steps, self.packed_attention, self.config.sliding_window)
        normed, all_hidden, all_valid = [], [], []
        for step in range(steps):
            tokens, valid = shift_within_documents(input_ids, document_ids, step + 1)  # token t+1+i
            embeds = self.embed_tokens(tokens)  # [B, L, H]
            rope = self.rotary_emb(embeds, position_ids + step)  # the i-th draft sits i places later
            mlp_rows = None if head_rows is None else head_rows.mlp[step]
            hidden = self.midlayer(embeds, hidden, rope, keys, mlp_rows)  # [B, L, H]
            if self.config.norm_output:  # EAGLE 3.1: the next step reads norm(out), the state lm_head reads
                hidden = self.norm(hidden)
            kept = hidden if head_rows is None else gather_rows(hidden, head_rows.logits[step])  # [B, L, H] | [N_i, H]
            normed.append((kept if self.config.norm_output else self.norm(kept)).reshape(-1, hidden.shape[-1]))
            all_hidden.append(hidden)
            all_valid.append(valid)
        # No step reads another step's logits, so the head runs once over every step's rows: one GEMM and one
        # weight gradient instead of one per step plus their sum (about 1.4x faster for the head on a CPU).
        logits = self.lm_head(torch.cat(normed)).split([n.shape[0] for n in normed])
        all_logits = list(logits) if head_rows is not None else [x.view(batch, length, -1) for x in logits]
        teacher = mass = None
        if last_hidden_state is not None and self.verifier_lm_head is not None:
            read_at = last_hidden_state
            if head_rows is not None and head_rows.teacher is not None:
                read_at = gather_rows(last_hidden_state, head_rows.teacher)  # [M, H]
            if self.teacher_in_vocab_mass:
                teacher, mass = self.teacher_distribution_and_mass(read_at)
            else:
                teacher = self.teacher_distribution(read_at)
        return Eagle3Output(logits=tuple(all_logits), hidden_states=tuple(all_hidden), step_valid=tuple(all_valid),
                            teacher_probs=teacher, teacher_in_vocab_mass=mass,
                            logits_mask=None if head_rows is None else head_rows.logits_mask,
                            teacher_mask=None if head_rows is None else head_rows.teacher_mask)

    # ------------------------------------------------------------------ inference: one step with a KV cache

    @torch.no_grad()
    def draft_step(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: tuple[torch.Tensor, torch.Tensor] | None = None,
        logits_to_keep: int = 0,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Process q new positions causally after a cache, as an engine does.

        input_ids [1, q] (the token after each feature), hidden_states [1, q, 3 x target_hidden] (verifier aux
        states) or [1, q, H] (the drafter's own previous output), position_ids [1, q]. Returns
        (logits [1, q, Vd], hidden [1, q, H] to feed back (pre-norm; post-norm with `norm_output`), (k, v) cache
        [1, nkv, S + q, hd]). Crop the cache to drop rejected drafts: `(k[:, :, :n], v[:, :, :n])`.
        `logits_to_keep` N > 0 computes the lm_head for the last N positions only (logits [1, N, Vd]), as in
        transformers' causal LMs. `attention_mask` bool [q, S + q] (True: may attend) replaces the causal mask,
        for a draft tree (cache + ancestors + itself).
        """
        self._check_embeddings()
        hidden = self.project_features(hidden_states)  # [1, q, H]
        embeds = self.embed_tokens(input_ids)  # [1, q, H]
        keys = DraftKeys(past_key_values, attention_mask, position_ids[0], self.config.sliding_window)
        hidden = self.midlayer(embeds, hidden, self.rotary_emb(embeds, position_ids), keys)  # [1, q, H]
        if self.config.norm_output:  # EAGLE 3.1: norm(out) is both what lm_head reads and what is fed back
            hidden = self.norm(hidden)
        kept = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        return self.lm_head(kept if self.config.norm_output else self.norm(kept)), hidden, keys.present

    # ------------------------------------------------------------------ checkpoints

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, include_embed_tokens: bool = False,
                        **kwargs: Any) -> Any:
        """Write the standard EAGLE-3 layout (eagle3_hf/model/checkpoint.py); refuses an unservable checkpoint."""
        state_dict = kwargs.pop("state_dict", None)
        if state_dict is None:
            state_dict = self.state_dict()
        state_dict = standard_state_dict(state_dict, self.config, include_embed_tokens=include_embed_tokens)
        kwargs.setdefault("max_shard_size", "100GB")  # one model.safetensors, the layout engines expect
        kwargs["state_dict"] = state_dict
        return super().save_pretrained(save_directory, *args, **kwargs)

    def should_save_on_this_rank(self, is_main_process: bool) -> bool:
        """Which process writes is the caller's `is_main_process`: the Trainer passes its `should_save` (rank 0, or
        each node's first process with --save_on_each_node). transformers 5 also requires global rank 0, which left
        every node but the first without weights under --save_on_each_node."""
        return is_main_process

    @classmethod
    def from_pretrained(  # type: ignore[override]  # narrower than PreTrainedModel's: a path or repo id, no None
        cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any,
        verifier: PreTrainedModel | torch.Tensor | None = None, revision: str | None = None,
        token: str | bool | None = None, dtype: torch.dtype | str | None = None,
        torch_dtype: torch.dtype | str | None = None, attn_implementation: str | None = None,
        cache_dir: str | None = None, device: str | torch.device | None = None, **kwargs: Any,
    ) -> Eagle3DraftModel:
        """Load our layout, the standard layout other tools publish, or the speculators layout, from a
        directory or a Hub repo id, asserting every name and shape lines up (checkpoint.read_drafter_checkpoint).
        `verifier` (a model) fills embed_tokens when the checkpoint has none."""
        if args:
            raise TypeError(f"unexpected positional arguments {args}")
        kwargs.pop("trust_remote_code", None)  # never needed: the drafter's code is this file
        if kwargs:
            raise TypeError(f"unsupported from_pretrained arguments: {sorted(kwargs)}")
        checkpoint = read_drafter_checkpoint(pretrained_model_name_or_path, revision=revision, token=token,
                                             cache_dir=cache_dir)
        config, tensors = checkpoint.config, checkpoint.tensors
        config._attn_implementation = attn_implementation or "sdpa"
        model = cls(config)
        has_embed = EMBED_KEY in tensors
        result = model.load_state_dict(tensors, strict=False)
        if result.unexpected_keys or [k for k in result.missing_keys if k != EMBED_KEY]:
            raise ValueError(f"{checkpoint.path}: state dict mismatch {result}")
        model.embed_tokens_loaded = has_embed
        if verifier is not None:
            model.load_verifier_embeddings(verifier)
        target_dtype = dtype or torch_dtype
        if isinstance(target_dtype, str) and target_dtype != "auto":
            target_dtype = getattr(torch, target_dtype)
        # PreTrainedModel.to is wrapped with functools.wraps, whose typeshed stub loses the bound self: mypy would
        # read the argument as `self`
        if isinstance(target_dtype, torch.dtype):
            model.to(target_dtype)  # type: ignore[arg-type]
        if device is not None:
            model.to(device)  # type: ignore[arg-type]
        model.eval()
        model.source_layout = checkpoint.layout
        return model

    def save_speculators(self, out_dir: str | os.PathLike,
                         verifier: PreTrainedModel | torch.Tensor | None = None) -> Path:
        """Write the speculators layout: `layers.0.*` names and the verifier's embedding included
        (speculators' loader leaves a missing embedding at zero; vLLM shares identical ones)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if verifier is not None:
            self.load_verifier_embeddings(verifier)
        self._check_embeddings()
        architectures = list(getattr(getattr(verifier, "config", None), "architectures", None) or []) or None
        return write_speculators(self.state_dict(), self.config, out, architectures)

    # transformers wraps PreTrainedModel.push_to_hub (functools.wraps), so mypy reads its signature as
    # (*args, **kwargs); this one is keyword-only on purpose
    def push_to_hub(  # type: ignore[override]
        self, repo_id: str, *, token: str | bool | None = None, private: bool | None = None,
        revision: str | None = None, commit_message: str | None = None, commit_description: str | None = None,
        create_pr: bool = False, max_shard_size: int | str | None = None, tags: list[str] | None = None,
        run_check: bool = True, **unknown: Any,
    ) -> str:
        """Check the drafter (eagle3_hf.publish.check), write our model card and upload the standard layout.
        transformers' own push would replace the card with a generic one and skip the check. Takes the
        arguments transformers' PushToHubMixin documents; any other is refused (TypeError), never dropped."""
        from ..publish.hub import push_drafter

        if unknown:
            raise TypeError(f"push_to_hub: unknown argument(s) {', '.join(sorted(unknown))} (it takes token, private, "
                            "revision, commit_message, commit_description, create_pr, tags, run_check)")
        if max_shard_size is not None:
            raise ValueError("push_to_hub: max_shard_size is not taken: a drafter is pushed as one model.safetensors, "
                             "the layout serving engines load")
        return push_drafter(self, repo_id, token=token, private=bool(private), revision=revision,
                            commit_message=commit_message, run_check=run_check, commit_description=commit_description,
                            create_pr=create_pr, tags=tags)

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
