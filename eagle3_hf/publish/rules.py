"""The rules of `eagle3-hf check`: each turns one way a checkpoint serves silently at τ ≈ 1 into a finding.

The layout, its shapes and the vocabulary-mapping rules are `eagle3_hf.model.checkpoint`'s, the aux-layer and
engine-config rules `eagle3_hf.model.configuration_eagle3`'s; this module says what each engine makes of a
violation. A rule reads a config dict and a weights reader (`CheckpointWeights`: names, shapes, dtypes, values
on demand) and adds to a `Report`. The engine behaviour each rule guards against, as read in their source:

- SGLang `python/sglang/srt/models/llama_eagle3.py`: `load_weights` maps a name `n` to `n` or `model.n` and
  skips anything else without a word (so `layers.0.*` and `model.lm_head.weight` are dropped); missing
  weights keep their random init. `d2t` becomes `hot_token_id = d2t + arange` (offsets). No
  `draft_vocab_size` -> lm_head is loaded from the verifier. `tie_word_embeddings` -> lm_head is the
  embedding. The decoder layer hard-codes residual = un-normed hidden (`norm_before_residual` ignored in
  every version read: `attention_rules.RESIDUAL_SUPPORT`).
  `set_embed` keeps the drafter's own embedding only when `target_hidden_size != hidden_size`.
- SGLang target models capture for `eagle_config.eagle_aux_hidden_state_layer_ids` what their model file's
  `set_eagle3_layers_to_capture` makes of them, per family (`aux_id_rules.py`: Llama + 1 to every id, DeepSeek-V3
  / Kimi since PR 25454 + 1 only when the first id is 1); with no ids (`model_runner.py` reads only
  `eagle_config`) they capture (2, N//2, N-3) as given. `configs/model_config.py` renames a `LlamaForCausalLM`
  draft to `LlamaForCausalLMEagle3`.
- vLLM `vllm/v1/worker/gpu_model_runner.py` (`_get_eagle3_aux_layers_from_config`; the CPU runner inherits it)
  reads the top-level `eagle_aux_hidden_state_layer_ids` and captures the stream entering layer id (the
  transformers `output_hidden_states` index, `model_executor/models/interfaces.py` `_maybe_add_hidden_state`);
  since PR 42764 it falls back to `eagle_config`'s ids *as they are* (no + 1), before it to the target's default
  (2, N//2, N-3). The V2 runner's `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py` (0.32.0) reads only the
  top-level key for EAGLE-3. `aux_id_rules.AUX_ID_READERS` holds each release's rule.
- EAGLE 3.1 options and the attention window (`attention_rules.py`): vLLM `llama_eagle3.py` reads `norm_before_fc`
  (`eagle_config` first), `fc_norm`, `norm_output`; SGLang's `llama_eagle3.py` (after PR 24663) reads `fc_norm`
  and `norm_output` but has no `input_norm`.
  `vllm/model_executor/models/llama_eagle3.py` renames `midlayer.` -> `layers.0.`, prefixes other names
  with `model.` (an already-prefixed name then fails to load), skips `t2d`, adds `arange` to `d2t`,
  honours `norm_before_residual` (`vllm/transformers_utils/configs/speculators/algos.py` defaults it to true
  for the speculators layout); `vllm/v1/spec_decode/llm_base_proposer.py` keeps a drafter's own
  `embed_tokens` unless it is absent or equal to the verifier's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..model.checkpoint import (
    BIAS_WEIGHTS,
    EMBED_KEY,
    FC_NORM_KEYS,
    INPUT_NORM_KEY,
    LAYER_WEIGHTS,
    VOCAB_BUFFERS,
    eagle31_options,
    expected_shapes,
    vocab_mapping_issues,
)
from ..verifier.family import engine_config_problems
from ..verifier.fit import drafter_misfits
from .attention_rules import check_eagle31, check_residual, check_window
from .aux_id_rules import check_aux_ids
from .llamacpp_rules import check_llamacpp
from .report import Report

if TYPE_CHECKING:
    import torch

FP16_MAX = 65504.0


def _init_like(w: torch.Tensor, initializer_range: float) -> str | None:
    """Why sampled rows `w` look like a fresh init (iid values, even row norms), or None.

    Deliberately narrow: iid N(0, initializer_range) (HF init), N(0, 1) (torch Embedding) or
    U(±1/sqrt(fan_in)) (torch Linear), with row norms as even as iid noise makes them. A trained matrix
    has uneven rows (frequent tokens grow), which is what keeps this from firing on real heads.
    """
    w = w.double()
    std, mean = float(w.std()), float(w.mean())
    if std == 0 or abs(mean) > 0.1 * std:
        return None
    cols = w.shape[1]
    norms = w.norm(dim=1)
    cv = float(norms.std() / norms.mean()) if norms.numel() > 1 else 0.0
    if cv > 3.0 / math.sqrt(2 * cols) + 0.01:
        return None
    kurt = float(((w - mean) ** 4).mean() / std**4)
    for target, name in ((initializer_range, f"N(0, {initializer_range:g})"), (1.0, "N(0, 1)")):
        if abs(std - target) < 0.15 * target and abs(kurt - 3) < 0.5:
            return f"iid {name}-like values (std {std:.4g}, row-norm spread {cv:.3f})"
    bound = 1 / math.sqrt(cols)
    if float(w.abs().max()) <= bound * 1.001 and abs(kurt - 1.8) < 0.3:
        return f"uniform(±1/sqrt({cols}))-like values, torch's default Linear init"
    return None


def check_config(cfg: dict, rep: Report, num_layers: int | None, family: str | None = None) -> None:
    """The config.json rules; `family` is the verifier's SGLang reader family (aux_id_rules), None if unknown."""
    arch = list(cfg.get("architectures") or [])
    if arch[:1] not in (["LlamaForCausalLMEagle3"], ["LlamaForCausalLM"]):
        rep.add("error", "architectures", f"architectures {arch} is not ['LlamaForCausalLMEagle3']: the engines "
                "pick the drafter class from it (SGLang maps only LlamaForCausalLM to its EAGLE-3 drafter)")
    if cfg.get("model_type") != "llama":
        rep.add("warning", "model-type", f"model_type {cfg.get('model_type')!r} is not 'llama': the engines parse "
                "config.json with that model type's config class (may need trust_remote_code); fields it does "
                "not know can be dropped")
    if cfg.get("num_hidden_layers", 1) != 1:
        rep.add("error", "num-layers", f"num_hidden_layers is {cfg.get('num_hidden_layers')}, the standard "
                "layout has exactly one (midlayer.*); engines would build extra random layers")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in cfg:
            rep.add("error", "config-key", f"config.json has no {key!r}")
    if "draft_vocab_size" not in cfg:
        rep.add("error", "draft-vocab-size", "no draft_vocab_size: SGLang then loads lm_head from the verifier "
                "(full vocabulary, ignoring this head) and vLLM expects a full-vocabulary lm_head", ("sglang", "vllm"))
    if cfg.get("tie_word_embeddings"):
        rep.add("error", "tied-embeddings", "tie_word_embeddings is true: SGLang then uses the embedding as lm_head "
                "and drops lm_head.weight; set it false", ("sglang",))
    if "rms_norm_eps" not in cfg:
        rep.add("warning", "rms-norm-eps", "no rms_norm_eps: loaders fall back to a default (1e-6 or 1e-5) "
                "that may differ from training")
    for code, message in engine_config_problems(cfg):
        rep.add("error", code, message)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg:
        where = f" (rope_parameters has {rope.get('rope_theta')})" if "rope_theta" in rope else ""
        rep.add("warning", "legacy-rope-theta", f"no top-level rope_theta{where}: SGLang, the speculators "
                "converter and older loaders read only the legacy key and fall back to 10000")
    elif "rope_theta" in rope and float(rope["rope_theta"]) != float(cfg["rope_theta"]):
        rep.add("warning", "legacy-rope-theta", f"top-level rope_theta {cfg['rope_theta']} != rope_parameters' "
                f"{rope['rope_theta']}: loaders reading different keys apply different RoPE")
    if rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
        rep.add("warning", "legacy-rope-scaling", f"rope_parameters uses {rope.get('rope_type')!r} scaling but "
                "there is no legacy rope_scaling: older loaders apply plain RoPE")
    t_hidden = cfg.get("target_hidden_size")
    if t_hidden is not None and t_hidden != cfg.get("hidden_size"):
        rep.add("warning", "target-hidden-size", f"target_hidden_size {t_hidden} != hidden_size "
                f"{cfg.get('hidden_size')}: engines cannot share the verifier's embedding; the drafter must "
                "carry its own trained embed_tokens")
    check_residual(cfg, rep)
    check_eagle31(cfg, rep)
    check_window(cfg, rep)
    check_aux_ids(cfg, rep, num_layers, family)
    check_llamacpp(cfg, rep, num_layers, family)


class CheckpointWeights:
    """Tensor names, shapes and dtypes from safetensors headers; values loaded on demand."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self.handles: dict[Path, Any] = {}  # safetensors handles
        self.where: dict[str, Path] = {}
        self.meta: dict[str, tuple[tuple[int, ...], str]] = {}  # name -> (shape, dtype)
        for path in files:
            handle = safe_open(str(path), framework="pt")
            self.handles[path] = handle
            for name in handle.keys():
                sl = handle.get_slice(name)
                self.where[name] = path
                self.meta[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][0]

    def dtype(self, name: str) -> str:
        return self.meta[name][1]

    def tensor(self, name: str, rows: slice | None = None) -> torch.Tensor:
        handle = self.handles[self.where[name]]
        return handle.get_tensor(name) if rows is None else handle.get_slice(name)[rows]

    def row_blocks(self, name: str, max_elems: int = 1 << 24) -> Iterator[torch.Tensor]:
        """The tensor in row blocks (float32), so a 32000 x 7168 head never sits in memory twice."""
        shape = self.shape(name)
        if len(shape) < 2:
            yield self.tensor(name).float()
            return
        step = max(1, max_elems // max(1, math.prod(shape[1:])))
        for start in range(0, shape[0], step):
            yield self.tensor(name, slice(start, min(start + step, shape[0]))).float()

    def sample_rows(self, name: str, blocks: int = 8, block: int = 128) -> torch.Tensor:
        import torch

        n = self.shape(name)[0]
        starts = sorted({int(i * max(0, n - block) / max(1, blocks - 1)) for i in range(blocks)})
        return torch.cat([self.tensor(name, slice(s, min(s + block, n))).float() for s in starts]).unique(dim=0)


def check_names_and_shapes(cfg: dict, w: CheckpointWeights, rep: Report) -> None:
    options = eagle31_options(cfg)
    eagle31 = ((INPUT_NORM_KEY,) if options["norm_before_fc"] else ()) + (FC_NORM_KEYS if options["fc_norm"] else ())
    allowed = set(LAYER_WEIGHTS + VOCAB_BUFFERS + (EMBED_KEY,) + (BIAS_WEIGHTS if cfg.get("attention_bias") else ())
                  + eagle31)
    stray = sorted(n for n in w.meta if n not in allowed and (n == INPUT_NORM_KEY or n in FC_NORM_KEYS))
    if stray:
        option = "norm_before_fc" if INPUT_NORM_KEY in stray else "fc_norm"
        rep.add("error", "eagle31-weights-without-option", f"{', '.join(stray)} present but {option} is not true in "
                "config.json: vLLM drops input_norm.weight silently (and refuses fc_norm.*), SGLang drops both "
                f"silently; the drafter then serves without the norms it was trained with: set {option}: true")
    unknown = sorted(n for n in w.meta if n not in allowed and n not in stray)
    spec = [n for n in unknown if n.startswith("layers.0.")]
    other = [n for n in unknown if n not in spec]
    if spec:
        rep.add("error", "speculators-names", f"{len(spec)} weights named layers.0.* (speculators layout, e.g. "
                f"{spec[0]}): SGLang drops them silently and serves a random layer; rename to midlayer.*", ("sglang",))
        rep.add("info", "speculators-names", "layers.0.* names load in vLLM (it renames midlayer. to layers.0.)",
                ("vllm",))
    if other:
        shown = ", ".join(other[:6]) + (" ..." if len(other) > 6 else "")
        rep.add("error", "unknown-weights", f"{len(other)} weight names outside the standard layout ({shown}): "
                "SGLang drops such names silently (random layer, τ ≈ 1), vLLM fails to load them; "
                "the standard names have no 'model.' prefix; llama.cpp's converter stops at a name it cannot map",
                ("sglang", "vllm", "llamacpp"))
    have = set(w.meta) | {n.replace("layers.0.", "midlayer.", 1) for n in spec}
    missing = [n for n in LAYER_WEIGHTS + eagle31 if n not in have]
    if "lm_head.weight" in missing:
        rep.add("error", "missing-lm-head", "no lm_head.weight: SGLang serves a randomly initialised head "
                "(τ ≈ 1), vLLM fails or does the same")
        missing.remove("lm_head.weight")
    if missing:
        rep.add("error", "missing-weights", f"missing {missing}: engines keep these layers randomly initialised")
    d2t_needed = cfg.get("draft_vocab_size", cfg.get("vocab_size")) != cfg.get("vocab_size")
    if "d2t" not in have and d2t_needed:
        rep.add("error", "missing-d2t", "draft_vocab_size < vocab_size but no d2t: engines map draft id i to "
                "verifier id i, so every proposal is the wrong token")
    if "d2t" in have and not d2t_needed:  # served by vLLM 0.32: docs/contracts.md, broken exports
        rep.add("error", "d2t-without-draft-vocab", f"d2t is present but draft_vocab_size "
                f"({cfg.get('draft_vocab_size', 'missing')}) is not smaller than vocab_size ({cfg.get('vocab_size')}): "
                "vLLM then builds no draft-to-target map and refuses the checkpoint (\"no module or parameter named "
                "'draft_id_to_target_id'\"); drop d2t and t2d, or keep a smaller draft vocabulary", ("vllm",))
    if "t2d" not in have:
        rep.add("info", "missing-t2d", "no t2d (the engines don't read it; eagle3_hf uses it to check d2t)")
    t_hidden = cfg.get("target_hidden_size")
    if t_hidden is not None and t_hidden != cfg.get("hidden_size") and "embed_tokens.weight" not in have:
        rep.add("error", "missing-embed-tokens", "target_hidden_size != hidden_size but no embed_tokens.weight: "
                "SGLang then keeps the drafter's randomly initialised embedding", ("sglang",))
    try:
        expected = expected_shapes(cfg, include_embed_tokens=True)
    except (KeyError, TypeError, ValueError):
        return  # already reported as a config error
    why = {"q_proj": " (q/k/v read cat(embedding, hidden): 2 x hidden_size inputs)",
           "fc.": " (fc maps 3 x target_hidden_size to hidden_size)", "lm_head": " ([draft_vocab_size, hidden_size])"}
    for name in sorted(set(w.meta) | set(spec)):
        key = name.replace("layers.0.", "midlayer.", 1)
        if key in expected and w.shape(name) != expected[key]:
            hint = next((v for k, v in why.items() if k in key), "")
            rep.add("error", "shape", f"{name} has shape {list(w.shape(name))}, config.json implies "
                    f"{list(expected[key])}{hint}")
    if "d2t" in w.meta and not w.dtype("d2t").startswith(("I", "U")):
        rep.add("error", "d2t-dtype", f"d2t has dtype {w.dtype('d2t')}; it must be an integer offset (int64)")
    if "t2d" in w.meta and w.dtype("t2d") != "BOOL":
        rep.add("warning", "t2d-dtype", f"t2d has dtype {w.dtype('t2d')}; the standard layout stores a bool mask")


def check_values(cfg: dict, w: CheckpointWeights, rep: Report) -> None:
    import torch

    non_finite: set[str] = set()
    for name in sorted(w.meta):
        if not w.dtype(name).startswith(("F", "BF")):
            continue
        finite, peak = True, 0.0
        for block in w.row_blocks(name):
            finite &= bool(torch.isfinite(block).all())
            peak = max(peak, float(block.nan_to_num(0, 0, 0).abs().max()) if block.numel() else 0.0)
        if not finite:
            rep.add("error", "non-finite", f"{name} contains NaN or Inf")
            non_finite.add(name)
        elif peak > 6e4:
            rep.add("warning", "fp16-overflow", f"{name} has |w| up to {peak:.3g}, at or beyond float16's "
                    f"{FP16_MAX:g}: serving with --dtype float16 overflows")
        elif name.endswith("norm.weight") and peak * math.sqrt(int(cfg.get("hidden_size", 1))) > FP16_MAX / 4:
            rep.add("warning", "fp16-overflow", f"{name} has gains up to {peak:.3g}: normed activations can "
                    "exceed float16's range; serve in bfloat16")
    init_range = float(cfg.get("initializer_range", 0.02))
    for name in ("lm_head.weight", "embed_tokens.weight"):
        if name not in w.meta or len(w.shape(name)) != 2 or w.shape(name)[0] == 0 or name in non_finite:
            continue  # a NaN row is neither zero nor constant: the non-finite finding is the true one
        rows = w.sample_rows(name)
        if not bool(rows.abs().gt(0).any()):
            rep.add("error", "untrained-" + name.split(".")[0], f"{name} is all zeros")
        elif rows.shape[0] == 1 and w.shape(name)[0] > 1:
            rep.add("error", "untrained-" + name.split(".")[0], f"every sampled row of {name} is identical: all "
                    "tokens would get the same logit")
        elif float(rows.std(dim=1).max()) == 0:
            rep.add("error", "untrained-" + name.split(".")[0], f"every sampled row of {name} is constant: the "
                    "logits only see the sum of the hidden state")
        elif (why := _init_like(rows, init_range)) is not None:
            what = "the head the engines serve" if name == "lm_head.weight" else "vLLM would use this embedding"
            rep.add("warning", "untrained-" + name.split(".")[0], f"{name} looks untrained: {why}; {what}")


def check_vocab_mapping(cfg: dict, w: CheckpointWeights, rep: Report, verifier_vocab: int | None) -> None:
    if "d2t" not in w.meta or len(w.shape("d2t")) != 1 or not w.dtype("d2t").startswith(("I", "U")):
        return
    vocab = int(verifier_vocab or cfg.get("vocab_size") or 0)
    t2d = w.tensor("t2d") if "t2d" in w.meta and len(w.shape("t2d")) == 1 else None
    for issue in vocab_mapping_issues(w.tensor("d2t"), t2d, vocab):
        rep.add(issue.level, issue.code, issue.message)


# the drafter fit's sizes (verifier/fit.py) as `check` reports them: code, and what a mismatch breaks
VERIFIER_FIT = {"vocab_size": ("verifier-vocab", "d2t, t2d and the shared embedding index a different vocabulary"),
                "target_hidden_size": ("verifier-hidden", "fc reads 3 x the verifier's hidden states")}


def check_verifier(cfg: dict, w: CheckpointWeights, rep: Report, vcfg: dict,
                   verifier_embedding: Callable[[], tuple[Any, str] | None] | None) -> None:
    """Sizes against the verifier's; a carried embed_tokens against the verifier's embedding, which
    `verifier_embedding()` returns as (weights reader, tensor name) when the verifier is local."""
    import torch

    for misfit in drafter_misfits(cfg, vcfg):  # the aux ids are check_aux_ids', against the verifier's depth
        if misfit.key in VERIFIER_FIT:
            code, why = VERIFIER_FIT[misfit.key]
            rep.add("error", code, f"{misfit.message}: {why}")
    if "embed_tokens.weight" not in w.meta or verifier_embedding is None:
        return
    found = verifier_embedding()
    if found is None or found[0].shape(found[1]) != w.shape("embed_tokens.weight"):
        rep.add("warning", "embed-differs", "the drafter carries embed_tokens.weight and the verifier's embedding "
                "could not be compared (not found or another shape); vLLM and llama.cpp use the drafter's own",
                ("vllm", "llamacpp"))
        return
    vw, vname = found
    n = w.shape("embed_tokens.weight")[0]
    blocks = [slice(s, min(s + 512, n)) for s in sorted({0, n // 2, max(0, n - 512)})]
    same = all(torch.equal(w.tensor("embed_tokens.weight", b), vw.tensor(vname, b)) for b in blocks)
    if not same:
        rep.add("error", "embed-differs", "embed_tokens.weight differs from the verifier's embedding: vLLM and "
                "llama.cpp then use the drafter's own (SGLang swaps in the verifier's), so the engines disagree; drop "
                "it from the checkpoint unless it was trained on purpose", ("vllm", "llamacpp"))
    else:
        rep.add("info", "embed-shared", "embed_tokens.weight equals the verifier's; engines share the verifier's")
