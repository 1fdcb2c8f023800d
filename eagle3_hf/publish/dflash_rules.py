"""`eagle3-hf check` for a DFlash drafter (config.json `architectures ["DFlashDraftModel"]`): what each engine reads
from its config and weights, and where it would serve something other than what was trained.

As read in the engines' source (docs/contracts.md, "A second drafter kind: DFlash"): vLLM 0.32
(`model_executor/models/qwen3_dflash.py`, `v1/spec_decode/dflash.py`, `eagle3_utils.get_eagle3_aux_layers_from_config`,
`gpu_model_runner._get_eagle3_aux_layers_from_config`), SGLang 0.5.23 (`srt/models/dflash.py`,
`srt/speculative/dflash_utils.py`, `dflash_worker_v2.py`) and llama.cpp (`conversion/qwen.py` `DFlashModel`,
`src/models/dflash.cpp`, `common/speculative.cpp`).
"""

from __future__ import annotations

from typing import Any

from ..model.dflash_checkpoint import layout_issues
from .report import Report
from .rules import CheckpointWeights

ALL = ("sglang", "vllm", "llamacpp")


def check_dflash_config(cfg: dict[str, Any], rep: Report, verifier: dict[str, Any] | None,
                        num_speculative_tokens: int | None = None) -> None:
    """The config rules; `verifier`: the verifier's text config when known."""
    dflash = cfg.get("dflash_config")
    if not isinstance(dflash, dict):
        rep.add("error", "dflash-config-missing", "no dflash_config: the mask token and the aux-layer ids live there "
                "(vLLM and llama.cpp refuse a drafter without a mask token; SGLang picks its own layers)", ALL)
        dflash = {}
    mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        rep.add("error", "dflash-mask-token", "no dflash_config.mask_token_id: vLLM refuses the drafter, llama.cpp "
                "aborts", ALL)
    ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
    layers = (verifier or {}).get("num_hidden_layers") or cfg.get("verifier_num_hidden_layers")
    if not ids:
        rep.add("error", "dflash-layer-ids", "no dflash_config.target_layer_ids: SGLang spreads its own over the "
                "verifier, vLLM sizes fc by the drafter's layer count, llama.cpp refuses the file", ALL)
    elif layers is not None and any(not 0 <= int(i) <= int(layers) - 2 for i in ids):
        rep.add("error", "dflash-layer-ids", f"dflash_config.target_layer_ids {ids} name layer outputs outside "
                f"0..{int(layers) - 2} of the {layers}-layer verifier (each id is a layer's output, the HF "
                "hidden_states index - 1; the last layer's is not capturable)", ALL)
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and ids and list(top) != [int(i) + 1 for i in ids]:
        rep.add("error", "dflash-layer-ids-vllm", f"top-level eagle_aux_hidden_state_layer_ids {top} is what vLLM "
                f"reads (as HF indices), and it disagrees with dflash_config.target_layer_ids {ids} + 1, which SGLang "
                "and llama.cpp read: drop it", ("vllm",))
    if cfg.get("eagle_config"):
        rep.add("error", "dflash-eagle-config", "eagle_config is present: vLLM's V1 runner takes its "
                "eagle_aux_hidden_state_layer_ids over dflash_config's (gpu_model_runner); drop it", ("vllm",))
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" not in rope:
        rep.add("error", "dflash-rope-theta", "no rope_theta: vLLM's DFlash layer then defaults to 1e6, llama.cpp "
                "to 1e4; write the verifier's", ALL)
    if cfg.get("head_dim") is None:
        rep.add("error", "dflash-head-dim", "no head_dim: vLLM and SGLang take Qwen3Config's default 128, llama.cpp "
                "hidden_size / heads; write it", ALL)
    types = cfg.get("layer_types") or []
    causal = cfg.get("is_causal") or dflash.get("causal") or "sliding_attention" in types
    if causal or cfg.get("use_sliding_window") or dflash.get("use_swa"):
        rep.add("error", "dflash-attention", "a layer marked causal or sliding (is_causal, dflash_config.causal or "
                "use_swa, layer_types sliding_attention, use_sliding_window): the engines then serve a causal or "
                "windowed block, trained here as a bidirectional full-attention one", ALL)
    if cfg.get("hidden_act", "silu") != "silu":
        rep.add("error", "dflash-activation", f"hidden_act {cfg.get('hidden_act')!r}: SGLang's DFlash layer is SiLU "
                "only", ("sglang",))
    block = dflash.get("block_size", cfg.get("block_size"))
    if block is None:
        rep.add("warning", "dflash-block-size", "no block_size: SGLang and llama.cpp assume 16", ("sglang", "llamacpp"))
    elif num_speculative_tokens is not None and num_speculative_tokens > int(block) - 1:
        rep.add("error", "dflash-block-size", f"{num_speculative_tokens} speculative tokens from a block of {block}: "
                f"positions past {int(block) - 1} were never trained (vLLM does not clamp; llama.cpp clamps to "
                f"{int(block) - 1})", ("vllm",))
    else:
        rep.add("info", "dflash-block-size", f"block_size {block}: draft at most {int(block) - 1} tokens per verify "
                "forward (vLLM: num_speculative_tokens, which it does not clamp; llama.cpp clamps; SGLang drafts "
                "block_size - 1)", ALL)
    if verifier is not None:
        for key in ("hidden_size", "vocab_size"):
            if verifier.get(key) is not None and cfg.get(key) != verifier.get(key):
                rep.add("error", f"dflash-verifier-{key.replace('_', '-')}", f"{key} {cfg.get(key)} != the verifier's "
                        f"{verifier.get(key)}: the drafter reads the verifier's embedding and lm_head", ALL)
        vocab = verifier.get("vocab_size")
        if mask is not None and vocab is not None and not 0 <= int(mask) < int(vocab):
            rep.add("error", "dflash-mask-token", f"mask_token_id {mask} lies outside the verifier's vocabulary of "
                    f"{vocab}", ALL)


def check_dflash_weights(cfg: dict[str, Any], w: CheckpointWeights, rep: Report) -> None:
    """Names and shapes against the served layout: SGLang drops unknown names silently (a random layer at τ ≈ 1),
    vLLM refuses them, llama.cpp's converter stops at `d2t`."""
    shapes = {name: _Shape(meta[0]) for name, meta in w.meta.items()}
    for issue in layout_issues(shapes, cfg):
        rep.add("error", "dflash-weights", issue, ALL)


class _Shape:
    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
