"""The rules of `eagle3-hf check --engine llamacpp`: what llama.cpp's GGUF converter and its EAGLE-3 loader make of a
standard-layout drafter, as read in the llama.cpp tree of `llama-cpp-python` 0.3.36 (llama.cpp commit 0c1e570,
ggml 0.25.3), the tree `make llamacpp` builds. Each rule turns one way the drafter would convert, load or serve
wrongly in llama.cpp into one finding, before any conversion (docs/contracts.md has the table):

- `conversion/llama.py` (`LlamaModel.__init__`): a checkpoint is converted as an EAGLE-3 drafter only when its
  config has `draft_vocab_size` and `num_hidden_layers` 1 (else as a plain Llama); the aux ids are the top-level
  `eagle_aux_hidden_state_layer_ids`, else [2, N//2, N-3] for the verifier's N layers (`eagle_config` is read
  nowhere); `norm_before_residual` and `norm_before_fc` from the top level only. `modify_tensors` maps `fc.weight`,
  `input_norm.weight`, `d2t` (`t2d` skipped) and `hidden_norm`; any other name goes through the Llama tensor map,
  which has no `fc_norm.*`, so the conversion stops there. `prepare_tensors` writes d2t as absolute ids
  (d2t + arange) and refuses any outside the verifier's vocabulary or any duplicate.
- `src/models/eagle3.cpp` (`load_arch_hparams`): exactly 3 extract layers; `norm_before_fc` adds the input norm
  tensor, and the loader refuses a file with tensors it did not create (`llama-model-loader.cpp`
  `done_getting_tensors`). The decoder graph carries the pre-norm state to the next step (the EAGLE 3.0
  recurrence: `norm_output` is not read) and attends to the whole context (no sliding window).
- `common/speculative.cpp` (`common_speculative_impl_draft_eagle3`): id k < N captures the input of target layer k
  (transformers' `hidden_states[k]`), id N the target's `nextn` state, which a Llama target does not produce.
"""

from __future__ import annotations

from .aux_id_rules import aux_ids_of, aux_ids_read, default_capture
from .report import Report

LLAMACPP = ("llamacpp",)
VERSION = "llama.cpp 0c1e570 (llama-cpp-python 0.3.36)"
CONVERTER = "conversion/llama.py"


def trained_indices(cfg: dict, n: int | None, family: str | None = None) -> list[int] | None:
    """The `output_hidden_states` indices the drafter was trained on, as far as the config says: our own record
    (`aux_hidden_state_indices`), else the top-level ids (vLLM's reading), else what every SGLang reader of
    `family` makes of `eagle_config`'s when they agree; None when unknown."""
    own = cfg.get("aux_hidden_state_indices")
    if own:
        return [int(i) for i in own]
    top, nested = aux_ids_of(cfg)
    if top:
        return top
    if nested:
        sglang = {str(got): got for r, got in aux_ids_read(cfg, n, family) if r.engine == "sglang"}
        agreed = next(iter(sglang.values())) if len(sglang) == 1 else None
        return agreed if isinstance(agreed, list) else None
    return None


def check_llamacpp(cfg: dict, rep: Report, n: int | None, family: str | None = None) -> None:
    """The config rules of llama.cpp's converter and loader (`n`: the verifier's depth, None when unknown)."""
    if "llamacpp" not in rep.engines:
        return
    _detection(cfg, rep)
    _aux_ids(cfg, rep, n, family)
    _options(cfg, rep)


def _detection(cfg: dict, rep: Report) -> None:
    if "draft_vocab_size" not in cfg or cfg.get("num_hidden_layers", 1) != 1:
        rep.add("error", "llamacpp-not-eagle3", "llama.cpp's converter takes a checkpoint for an EAGLE-3 drafter only "
                f"when config.json has draft_vocab_size and num_hidden_layers 1 ({CONVERTER}, {VERSION}); this one "
                "would be converted as a plain Llama", LLAMACPP)


def _aux_ids(cfg: dict, rep: Report, n: int | None, family: str | None) -> None:
    top, nested = aux_ids_of(cfg)
    if top is not None and len(top) != 3:
        rep.add("error", "llamacpp-aux-count", f"eagle_aux_hidden_state_layer_ids has {len(top)} ids {top}: "
                f"llama.cpp's loader refuses any count but 3 (src/models/eagle3.cpp load_arch_hparams, {VERSION})",
                LLAMACPP)
        return
    read = top or default_capture(n)
    trained = trained_indices(cfg, n, family)
    if top is None:
        if not isinstance(read, list):
            rep.add("warning", "llamacpp-aux-ids", "no top-level eagle_aux_hidden_state_layer_ids: llama.cpp reads "
                    f"nothing else (not eagle_config) and captures (2, N//2, N-3) ({CONVERTER}, {VERSION}); right only "
                    "if the drafter was trained on those indices: add the top-level ids", LLAMACPP)
        elif trained is None or trained != read:
            said = f"was trained on {trained}" if trained else "records no training indices"
            rep.add("error" if trained else "warning", "llamacpp-aux-ids", "no top-level "
                    f"eagle_aux_hidden_state_layer_ids: llama.cpp reads nothing else (not eagle_config"
                    f"{f' {nested}' if nested else ''}) and captures its default {read}, but the drafter {said} "
                    f"({CONVERTER}, {VERSION}); add the top-level ids", LLAMACPP)
        return
    own = cfg.get("aux_hidden_state_indices")
    if own and [int(i) for i in own] != top:
        rep.add("error", "llamacpp-aux-ids", f"top-level eagle_aux_hidden_state_layer_ids {top}, which llama.cpp "
                f"captures as target layer inputs ({CONVERTER}; common/speculative.cpp), differ from the indices the "
                f"drafter was trained on, aux_hidden_state_indices {list(own)}", LLAMACPP)
    if n is not None and any(i == n for i in top):
        rep.add("error", "llamacpp-aux-last", f"aux id {n} (the verifier's last state): llama.cpp captures it as the "
                "target's nextn state, which a Llama-family target never produces, and aborts at the first prompt "
                f"(common/speculative.cpp, {VERSION})", LLAMACPP)


def _options(cfg: dict, rep: Report) -> None:
    eagle = cfg.get("eagle_config")
    nested: dict = eagle if isinstance(eagle, dict) else {}
    if "norm_before_fc" in nested and bool(nested["norm_before_fc"]) != bool(cfg.get("norm_before_fc", False)):
        rep.add("error", "llamacpp-norm-before-fc", f"eagle_config.norm_before_fc is {nested.get('norm_before_fc')} "
                f"but the top-level key is {cfg.get('norm_before_fc', False)}: llama.cpp reads only the top level "
                f"({CONVERTER}, {VERSION}); write the same value in both", LLAMACPP)
    if cfg.get("fc_norm") or cfg.get("use_aux_norm"):
        rep.add("error", "llamacpp-fc-norm", "fc_norm is true (EAGLE 3.1): llama.cpp has no fc_norm; its converter "
                f"cannot map fc_norm.* and stops ({CONVERTER} modify_tensors, {VERSION})", LLAMACPP)
    if cfg.get("norm_output"):
        rep.add("error", "llamacpp-norm-output", "norm_output is true (EAGLE 3.1): llama.cpp ignores it and feeds the "
                "pre-norm state to the next draft step, silently (src/models/eagle3.cpp, the decoder graph, "
                f"{VERSION})", LLAMACPP)
    layer = cfg.get("transformer_layer_config")
    keys = layer if isinstance(layer, dict) else cfg
    if keys.get("sliding_window") is not None and "sliding_attention" in (keys.get("layer_types") or []):
        rep.add("error", "llamacpp-window", f"sliding_window {keys['sliding_window']}: llama.cpp's EAGLE-3 drafter "
                f"attends to the whole context, the window is neither converted nor read ({CONVERTER}; "
                f"src/models/eagle3.cpp, {VERSION})", LLAMACPP)
    if cfg.get("norm_before_residual"):
        rep.add("warning", "llamacpp-norm-before-residual", "norm_before_residual is true: llama.cpp computes the "
                "residual from hidden_norm(h) (src/models/eagle3.cpp), right only if the drafter was trained so",
                LLAMACPP)
