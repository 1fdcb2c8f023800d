"""The model card says what was measured: a chain or a tree, and the serve flags the sweep recommended."""

from __future__ import annotations

import json

from eagle3_hf.evaluation.sweep import summarise
from eagle3_hf.publish.model_card import DEFAULT_SGLANG_FLAGS, build_model_card

CONFIG = {"model_type": "llama", "hidden_size": 64, "draft_vocab_size": 32, "vocab_size": 128,
          "eagle_aux_hidden_state_layer_ids": [2, 4, 5]}
EVALUATION = {"engine": "transformers", "k": 3, "temperature": 0.0, "prompts": "mt-bench", "num_prompts": 10,
              "acceptance_length": 1.46, "per_position_acceptance": [0.3, 0.1, 0.05], "speedup": 1.0,
              "lossless": True}


def drafter_dir(tmp_path, evaluation=None, sweep=None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    if evaluation is not None:
        (tmp_path / "eagle3_evaluation.json").write_text(json.dumps(evaluation))
    if sweep is not None:
        (tmp_path / "eagle3_sweep.json").write_text(json.dumps(sweep))
    return tmp_path


def sweep_json(rows):
    meta = {"prompts": "dev", "num_prompts": 5, "max_new_tokens": 48, "temperature": 0.0, "device": "cpu"}
    return summarise(rows, meta)


def row(steps, topk, n, tau, speedup, low, high):
    return {"steps": steps, "topk": topk, "num_draft_tokens": n, "acceptance_length": tau, "speedup": speedup,
            "speedup_low": low, "speedup_high": high}


def test_a_tree_evaluation_is_called_a_tree_and_a_chain_a_chain(tmp_path):
    chain = str(build_model_card(drafter_dir(tmp_path / "c", EVALUATION)))
    assert "chain drafting with k = 3 draft tokens per step" in chain and "tree drafting" not in chain
    tree = {**EVALUATION, "topk": 4, "num_draft_tokens": 8, "tree_attention": "sglang"}
    text = str(build_model_card(drafter_dir(tmp_path / "t", tree)))
    assert "tree drafting with S = 3 steps, top-K = 4, N = 8 draft tokens (tree attention as SGLang drafts)" in text
    assert "chain drafting with k" not in text


def test_serve_flags_are_the_sweeps_recommendation(tmp_path):
    # a tree whose interval clears the chain's: the sweep recommends it, with a tree-capable attention backend
    sweep = sweep_json([row(3, 1, 4, 1.5, 1.05, 1.01, 1.09), row(3, 4, 8, 2.1, 1.40, 1.30, 1.50)])
    assert sweep["recommendation"]["topk"] == 4
    text = str(build_model_card(drafter_dir(tmp_path, EVALUATION, sweep), "org/drafter"))
    assert ("--speculative-draft-model-path org/drafter --speculative-algorithm EAGLE3 --speculative-num-steps 3 "
            "--speculative-eagle-topk 4 --speculative-num-draft-tokens 8 --attention-backend flashinfer") in text
    assert DEFAULT_SGLANG_FLAGS not in text
    assert "the sweep's recommendation: tree drafting, S = 3 steps, top-K = 4, N = 8 draft tokens" in text
    assert '"num_speculative_tokens": 3' in text  # vLLM drafts chains: the sweep's best chain


def test_without_a_sweep_the_card_says_the_flags_are_the_default_chain(tmp_path):
    text = str(build_model_card(drafter_dir(tmp_path, EVALUATION), "org/drafter"))
    assert DEFAULT_SGLANG_FLAGS in text and "no sweep recorded" in text


def test_the_card_says_which_engines_serve_an_eagle31_or_windowed_layer(tmp_path):
    plain = build_model_card(drafter_dir(tmp_path / "plain")).text
    assert "EAGLE 3.1" not in plain and "sliding-window" not in plain
    CONFIG.update(norm_before_fc=True, norm_output=True, sliding_window=256, layer_types=["sliding_attention"])
    try:
        text = build_model_card(drafter_dir(tmp_path / "31")).text
    finally:
        for key in ("norm_before_fc", "norm_output", "sliding_window", "layer_types"):
            CONFIG.pop(key)
    assert "EAGLE 3.1: `norm_before_fc`, `norm_output`; vLLM serves it, SGLang since 0.5.17" in text
    assert "sliding-window attention over the last 256 tokens" in text


def test_a_llamacpp_evaluation_and_a_gguf_are_in_the_card(tmp_path):
    path = drafter_dir(tmp_path / "d", EVALUATION)
    assert "llama" + ".cpp" not in str(build_model_card(path))  # nothing measured or shipped: nothing said
    served = {"engine": "llamacpp", "llamacpp_version": "0.5.0-dev (build 1, commit 0c1e570)", "k": 3,
              "spec_draft_p_min": 0.0, "prompts": "mt-bench", "num_prompts": 10, "max_new_tokens": 64,
              "acceptance_length": 1.192, "acceptance_length_as_evaluate_counts": 1.189, "speedup": 0.61,
              "lossless": True, "transformers_acceptance_length": 1.188, "gap": 0.001}
    (path / "eagle3_evaluation_llamacpp.json").write_text(json.dumps(served))
    (path / "eagle3-drafter-f16.gguf").write_bytes(b"GGUF")
    card = str(build_model_card(path))
    assert "## Served by llama.cpp" in card and "τ = **1.19** per verify cycle" in card
    assert "token-identical to plain llama-server: yes" in card and "train/serve gap (llama.cpp − ours) +0.001" in card
    assert "llama-server -m VERIFIER.gguf -md eagle3-drafter-f16.gguf --spec-type draft-eagle3" in card


def test_the_serve_lines_set_the_thinking_mode_the_drafter_was_trained_in(tmp_path):
    """A drafter trained on Kimi-K2.5 text rendered with thinking off must be served with thinking off: every serve
    line sets the recorded chat-template kwargs as the server's default (vLLM and SGLang spell the flag alike)."""
    path = drafter_dir(tmp_path / "off")
    config = {**CONFIG, "verifier_chat_template_kwargs": {"thinking": False}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "eagle3-drafter-f16.gguf").write_bytes(b"GGUF")
    card = str(build_model_card(path))
    flag = """--default-chat-template-kwargs '{"thinking": false}'"""
    assert f"vllm serve VERIFIER {flag} --speculative-config" in card
    assert f"python -m sglang.launch_server --model VERIFIER {flag} --speculative-draft-model-path" in card
    assert """--jinja --chat-template-kwargs '{"thinking": false}'""" in card  # llama-server's spelling
    assert """chat-template kwargs `{"thinking": false}` (the thinking mode)""" in card
    # nothing recorded (an older drafter) or nothing rendered with (a template without a switch): no flag, no line
    for recorded in (None, {}):
        (path / "config.json").write_text(json.dumps({**CONFIG, "verifier_chat_template_kwargs": recorded}))
        card = str(build_model_card(path))
        assert "chat-template-kwargs" not in card and "thinking mode" not in card
