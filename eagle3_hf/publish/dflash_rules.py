"""`eagle3-hf check` on a DFlash drafter (config.json `architectures ["DFlashDraftModel"]`, engines/table.py): the
ways its config and weights are read differently by vLLM, SGLang and llama.cpp, each turned into a finding for the
engines it concerns. What each engine reads is in docs/contracts.md ("What engines read for DFlash"), read in vLLM
0.32.0 (`model_executor/models/qwen3_dflash.py`, `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`), llama.cpp
0c1e570 (`conversion/qwen.py` `DFlashModel`, `src/models/dflash.cpp`, `common/speculative.cpp`) and SGLang 0.5.23
(`srt/models/dflash.py`, `srt/speculative/dflash_utils.py`, `srt/speculative/dflash_worker_v2.py`).
"""

from __future__ import annotations

from typing import Any

from .report import Report
from .rules import CheckpointWeights

# a Qwen3 config without head_dim means 128 to vLLM and SGLang (transformers' Qwen3Config default) and
# hidden / heads to llama.cpp's converter
QWEN3_DEFAULT_HEAD_DIM = 128
DEFAULT_BLOCK_SIZE = 16  # what SGLang and llama.cpp assume without one
LAYER_NAMES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
               "post_attention_layernorm.weight")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def dflash_shapes(cfg: dict, num_ids: int) -> dict[str, tuple[int, ...]]:
    """The served layout's names and shapes, from config.json and the number of aux ids."""
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (hidden, num_ids * hidden), "hidden_norm.weight": (hidden,),
                                          "norm.weight": (hidden,)}
    per_layer = dict(zip(LAYER_NAMES, ((heads * head_dim, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden),
                                       (hidden, heads * head_dim), (head_dim,), (head_dim,), (inter, hidden),
                                       (inter, hidden), (hidden, inter), (hidden,), (hidden,))))
    for i in range(int(cfg["num_hidden_layers"])):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return shapes


def check_dflash_config(cfg: dict, rep: Report, verifier: dict | None) -> list[int]:
    """The config's findings; returns the aux ids (`dflash_config.target_layer_ids`) as written, [] when unusable."""
    found = cfg.get("dflash_config")
    dflash: dict[str, Any] = found if isinstance(found, dict) else {}
    if cfg.get("model_type") != "qwen3":
        rep.add("error", "dflash-model-type", f"model_type {cfg.get('model_type')!r}: the engines read a DFlash "
                "drafter's config as a Qwen3 config (vLLM builds it by model_type); write \"qwen3\"")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size"):
        if not _int(cfg.get(key)):
            rep.add("error", "bad-config", f"config.json {key} is {cfg.get(key)!r}: a DFlash config needs it")
    vocab = _int((verifier or {}).get("vocab_size")) or _int(cfg.get("vocab_size"))
    mask = _int(dflash.get("mask_token_id"))
    if mask is None or mask < 0 or (vocab is not None and mask >= vocab):
        rep.add("error", "dflash-mask-token", f"dflash_config.mask_token_id is {dflash.get('mask_token_id')!r}: "
                f"it must be a verifier token id (0..{vocab - 1 if vocab else 'vocab-1'}); vLLM refuses to start "
                "without it, llama.cpp's GGUF then has no mask token and SGLang looks up \"<|MASK|>\" instead")
    ids = dflash.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or any(_int(i) is None for i in ids):
        rep.add("error", "dflash-aux-ids", f"dflash_config.target_layer_ids is {ids!r}: without a list of layer ids "
                "each engine captures its own default layers (vLLM even sizes fc by the drafter's layer count)")
        ids = []
    layers = _int((verifier or {}).get("num_hidden_layers")) or _int(cfg.get("verifier_num_hidden_layers"))
    if ids and layers is not None and any(not 0 <= i <= layers - 2 for i in ids):
        rep.add("error", "aux-ids-range", f"dflash_config.target_layer_ids {ids}: each names a layer's output, "
                f"0..{layers - 2} for this {layers}-layer verifier (the last layer's output is after the final norm, "
                "which no engine captures)")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if top is not None and ids and list(top) != [i + 1 for i in ids]:
        rep.add("error", "dflash-aux-ids-mismatch", f"top-level eagle_aux_hidden_state_layer_ids {top} is read by "
                f"vLLM before dflash_config.target_layer_ids {ids} (as indices: it expects {[i + 1 for i in ids]}), "
                "while SGLang and llama.cpp read only the latter: drop the top-level key", ("vllm",))
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested is not None and ids and list(nested) != [i + 1 for i in ids]:  # v1/worker/gpu_model_runner.py
        rep.add("error", "dflash-aux-ids-mismatch", f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} "
                f"overrides dflash_config.target_layer_ids {ids} in vLLM's model runner "
                "(`_get_eagle3_aux_layers_from_config`, as indices), while SGLang and llama.cpp read only the latter: "
                "drop eagle_config", ("vllm",))
    block = _int(dflash.get("block_size")) or _int(cfg.get("block_size"))
    if block is None:
        rep.add("warning", "dflash-block-size", f"no block_size (top level or dflash_config): SGLang and llama.cpp "
                f"assume {DEFAULT_BLOCK_SIZE}, and draft as many tokens as that allows", ("sglang", "llamacpp"))
    heads, hidden = _int(cfg.get("num_attention_heads")), _int(cfg.get("hidden_size"))
    if cfg.get("head_dim") is None and heads and hidden and hidden // heads != QWEN3_DEFAULT_HEAD_DIM:
        rep.add("error", "dflash-head-dim", f"no head_dim: vLLM and SGLang take Qwen3's default "
                f"{QWEN3_DEFAULT_HEAD_DIM}, llama.cpp hidden / heads = {hidden // heads}; write head_dim")
    given = cfg.get("rope_parameters")
    rope: dict[str, Any] = given if isinstance(given, dict) else {}
    if cfg.get("rope_theta") is None and rope.get("rope_theta") is None:
        rep.add("warning", "dflash-rope-theta", "no rope_theta: the engines fall back to a default (1e4 in llama.cpp "
                "and in vLLM through transformers 5, 1e6 in vLLM's own DFlash layer with older transformers); "
                "write the theta the drafter was trained with")
    causal = cfg.get("is_causal", dflash.get("causal"))
    sliding = [i for i, t in enumerate(cfg.get("layer_types") or []) if t == "sliding_attention"]
    if causal or sliding or dflash.get("use_swa") or cfg.get("use_sliding_window"):
        rep.add("error", "dflash-causal", f"the config makes the block attention causal or windowed (is_causal / "
                f"dflash_config.causal {causal}, sliding layers {sliding}, use_swa / use_sliding_window): a DFlash "
                "drafter here is trained bidirectional within the block over full attention")
    target = _int((verifier or {}).get("hidden_size"))
    if target is not None and hidden is not None and target != hidden:
        rep.add("error", "dflash-hidden-size", f"hidden_size {hidden} differs from the verifier's {target}: llama.cpp "
                "and SGLang size fc as ids x the drafter's hidden size (vLLM would need target_hidden_size)")
    return [int(i) for i in ids]


def check_dflash_weights(cfg: dict, w: CheckpointWeights, rep: Report, ids: list[int]) -> None:
    """Names and shapes against the served layout; the verifier's parts a drafter must not carry."""
    try:
        shapes = dflash_shapes(cfg, len(ids) or 1)
    except (KeyError, TypeError, ValueError):
        return  # the config's own findings say why
    names = set(w.meta)
    prefixed = sorted(n for n in names if n.startswith("model."))
    if prefixed:
        rep.add("error", "dflash-model-prefix", f"{len(prefixed)} names start with 'model.' (e.g. {prefixed[0]}): "
                "vLLM prepends it itself and then finds no such module", ("vllm",))
    plain = {n.removeprefix("model."): n for n in names}
    head = sorted(n for n in plain if n.split(".")[0] in ("lm_head", "embed_tokens", "d2t", "t2d"))
    if head:
        rep.add("error", "dflash-verifier-parts", f"{', '.join(head)}: SGLang ignores them silently and serves with "
                "the verifier's embedding and head, llama.cpp's DFlash converter has no place for d2t / t2d, and "
                "vLLM serves a head of its own: a drafter all three serve alike uses the verifier's")
    unknown = sorted(plain[n] for n in plain if n not in shapes and n not in head)
    if unknown:
        shown = ", ".join(unknown[:6]) + (" ..." if len(unknown) > 6 else "")
        rep.add("error", "unknown-weights", f"{len(unknown)} weight names outside the DFlash layout ({shown}): SGLang "
                "drops them silently (a random layer, τ ≈ 1), vLLM and llama.cpp's converter refuse them")
    missing = [n for n in shapes if n not in plain]
    if missing:
        rep.add("error", "missing-weights", f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}: SGLang keeps "
                "these randomly initialised, vLLM and llama.cpp refuse the checkpoint")
    bad = [f"{plain[n]} {tuple(w.shape(plain[n]))} (expected {s})" for n, s in shapes.items()
           if n in plain and tuple(w.shape(plain[n])) != s]
    if bad:
        rep.add("error", "shape", f"shapes that disagree with config.json and {len(ids) or '?'} aux ids: "
                f"{'; '.join(bad[:4])}")
