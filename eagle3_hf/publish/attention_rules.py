"""The rules of `eagle3-hf check` for what the drafter's layer computes beyond EAGLE-3's: the normed residual
(`norm_before_residual`), the EAGLE 3.1 options and a sliding attention window. Per engine, which versions read
each one, with the engine file it was read from; an engine no version of which serves an option is an error for
that engine, the versions before one that does a warning (they serve it with the wrong math, silently)."""

from __future__ import annotations

from dataclasses import dataclass

from ..model.checkpoint import eagle31_options
from .report import Report

# ---------------------------------------------------------------- EAGLE 3.1 options: which engine versions serve them

@dataclass(frozen=True)
class OptionSupport:
    """Whether one engine serves one EAGLE 3.1 option: `since` names the first version that does (None: no version
    read here does), `before` what earlier versions (or, with `since` None, all) do with it, `source` the file."""

    since: str | None
    before: str
    source: str


EAGLE31_SUPPORT: dict[str, dict[str, OptionSupport]] = {
    "norm_before_fc": {
        "vllm": OptionSupport("PR 36545 (Mar 2026; the top-level key; eagle_config's, read first, since PR 42143)",
                              "no input_norm: input_norm.weight is refused at load",
                              "vllm/model_executor/models/llama_eagle3.py (LlamaModel.__init__, combine_hidden_states);"
                              " speculators layout: vllm/transformers_utils/configs/speculators/algos.py"),
        "sglang": OptionSupport("0.5.17 (read in the 0.5.17 to 0.5.23 releases; eagle_config's key first, then the "
                                "top level)", "no input_norm (0.5.15, 0.5.16 read): load_weights skips names it has "
                                "no parameter for, so input_norm.weight is dropped silently and fc reads un-normed "
                                "features",
                                "python/sglang/srt/models/llama_eagle3.py (LlamaModel.__init__: input_norm; forward)"),
    },
    "fc_norm": {
        "vllm": OptionSupport("PR 42764 (May 2026)", "no fc_norm: fc_norm.* weights are refused at load",
                              "vllm/model_executor/models/llama_eagle3.py (LlamaModel.fc_norm, combine_hidden_states); "
                              "speculators layout: algos.py of 0.32.0"),
        "sglang": OptionSupport("PR 24663 (May 2026; also as use_aux_norm; in every release read, 0.5.15 to 0.5.23)",
                                "no fc_norm: fc_norm.* weights are "
                                "dropped silently and fc reads un-normed features",
                                "python/sglang/srt/models/llama_eagle3.py (LlamaModel.fc_norm)"),
    },
    "norm_output": {
        "vllm": OptionSupport("PR 42764 (May 2026; the speculators layout since PR 46488, which passes the key on "
                              "in algos.py)", "the key is ignored silently: the next step reads the pre-norm "
                              "state (the EAGLE 3.0 recurrence)",
                              "vllm/model_executor/models/llama_eagle3.py (LlamaModel.forward: aux_output); "
                              "vllm/transformers_utils/configs/speculators/algos.py"),
        "sglang": OptionSupport("PR 24663 (May 2026; in every release read, 0.5.15 to 0.5.23)",
                                "the key is ignored silently: the next step reads the pre-norm state (the EAGLE 3.0 "
                                "recurrence)",
                                "python/sglang/srt/models/llama_eagle3.py (LlamaModel.forward: aux)"),
    },
}


def check_eagle31(cfg: dict, rep: Report) -> None:
    """Per EAGLE 3.1 option the config turns on: an error for an engine no version of which serves it, a warning
    naming the versions that serve it with the wrong math, silently; and the inconsistent combinations."""
    options = eagle31_options(cfg)
    eagle = cfg.get("eagle_config")
    nested: dict = eagle if isinstance(eagle, dict) else {}
    if "norm_before_fc" in nested and bool(nested["norm_before_fc"]) != bool(cfg.get("norm_before_fc", False)):
        rep.add("error", "norm-before-fc-keys", f"eagle_config.norm_before_fc is {nested['norm_before_fc']} but the "
                f"top-level key is {cfg.get('norm_before_fc', False)}: vLLM since PR 42143 reads eagle_config's, "
                "before it the top level; write the same value in both", ("vllm",))
    elif nested.get("norm_before_fc") and not cfg.get("norm_before_fc"):
        rep.add("warning", "norm-before-fc-keys", "norm_before_fc only in eagle_config: vLLM before PR 42143 reads "
                "only the top-level key and serves without input_norm; write it at the top level too", ("vllm",))
    if options["norm_before_fc"] and options["fc_norm"]:
        rep.add("error", "norm-before-fc-and-fc-norm", "norm_before_fc and fc_norm are both true: vLLM applies both "
                "(input_norm, then fc_norm), speculators refuses the pair; no trainer here produces it")
    if cfg.get("use_aux_norm") and not options["fc_norm"]:
        rep.add("error", "use-aux-norm", "use_aux_norm (SGLang's legacy name of fc_norm) without fc_norm: vLLM reads "
                "only fc_norm and serves without the per-aux norms; write fc_norm: true", ("vllm",))
    for option, on in options.items():
        if not on:
            continue
        for engine, support in EAGLE31_SUPPORT[option].items():
            if support.since is None:
                rep.add("error", f"{option.replace('_', '-')}-unserved", f"{option} is true: no {engine} version "
                        f"read here serves it ({support.before}; {support.source})", (engine,))
            else:
                rep.add("warning", f"{option.replace('_', '-')}-versions", f"{option} is true: {engine} serves it "
                        f"since {support.since}; before that, {support.before} ({support.source})", (engine,))


# ---------------------------------------------------------------- the normed residual: norm_before_residual

RESIDUAL_SUPPORT: dict[str, OptionSupport] = {
    "vllm": OptionSupport("0.32.0 (its installed source) and commit 00bd1493; earlier versions not read here",
                          "not read here",
                          "vllm/model_executor/models/llama_eagle3.py (LlamaDecoderLayer: _norm_before_residual when "
                          "getattr(config, 'norm_before_residual', False)); speculators layout: "
                          "vllm/transformers_utils/configs/speculators/algos.py (update_eagle3: true when missing)"),
    "sglang": OptionSupport(None, "the key is read nowhere: the layer sets residual = hidden_states before "
                            "hidden_norm, so the drafter serves with the un-normed residual, silently; read in the "
                            "releases 0.5.15-0.5.18, 0.5.20, 0.5.22, 0.5.23 and commits 03d5a777, d737979c",
                            "python/sglang/srt/models/llama_eagle3.py (LlamaDecoderLayer.forward)"),
}


def check_residual(cfg: dict, rep: Report) -> None:
    """`norm_before_residual` true: an error for an engine no version of which computes it (SGLang serves the
    un-normed residual), and for vLLM, which honours the key, a warning that it must match training: a drafter
    trained with false and served with true ran at τ 1.03 instead of 1.36 in vLLM 0.32 (docs/contracts.md)."""
    if not cfg.get("norm_before_residual"):
        return
    for engine, support in RESIDUAL_SUPPORT.items():
        if support.since is None:
            rep.add("error", "norm-before-residual", f"norm_before_residual is true: no {engine} version read here "
                    f"serves it ({support.before}; {support.source})", (engine,))
        else:
            rep.add("warning", "norm-before-residual", f"norm_before_residual is true: {engine} {support.since} "
                    "computes the residual from hidden_norm(h), right only if the drafter was trained so (`train "
                    "--norm-before-residual`, speculators' default); trained with false and served so, a drafter ran "
                    f"at τ 1.03 instead of 1.36 in vLLM 0.32 ({support.source})", (engine,))


# ---------------------------------------------------------------- the sliding attention window

WINDOW_SUPPORT: dict[str, OptionSupport] = {
    "vllm": OptionSupport("0.32.0 (its installed source) and the versions whose llama_eagle3.py sets "
                          "target_layer_count (read at commit 00bd1493)",
                          "not read here",
                          "vllm/model_executor/models/llama.py (LlamaAttention: layer_types[i] == 'sliding_attention' "
                          "-> per_layer_sliding_window = sliding_window); llama_eagle3.py (target_layer_count); "
                          "speculators layout: configs/speculators/base.py passes transformer_layer_config on whole"),
    "sglang": OptionSupport(None, "the drafter's RadixAttention is built without sliding_window_size, so it attends "
                            "to the whole context; PR 24664, Jul 2026, adds a window for EAGLE-3 drafters, its "
                            "reader not read here",
                            "python/sglang/srt/models/llama_eagle3.py -> llama.py (LlamaAttention)"),
}


def check_window(cfg: dict, rep: Report) -> None:
    """A window applies where vLLM applies it: `sliding_window` with `layer_types` marking the layer sliding. A
    window half-written (no `layer_types`) serves with full attention on vLLM, silently."""
    layer = cfg.get("transformer_layer_config")
    keys = layer if isinstance(layer, dict) else cfg  # the speculators layout nests the layer's config
    window, types = keys.get("sliding_window"), keys.get("layer_types")
    if window is None:
        return
    if not types or "sliding_attention" not in types:
        if types is None:
            rep.add("warning", "window-without-layer-types", f"sliding_window {window} without layer_types: vLLM's "
                    "LlamaAttention applies a window only where layer_types says 'sliding_attention', so this drafter "
                    "serves with full attention; write layer_types [\"sliding_attention\"] if it was trained with one",
                    ("vllm",))
        return
    for engine, support in WINDOW_SUPPORT.items():
        if support.since is None:
            rep.add("error", "window-unserved", f"sliding_window {window}: no {engine} version read here serves it "
                    f"({support.before}; {support.source})", (engine,))
        else:
            rep.add("info", "window-versions", f"sliding_window {window}: {engine} serves it in {support.since} "
                    f"({support.source})", (engine,))
