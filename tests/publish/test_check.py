"""`eagle3-hf check` on crafted broken checkpoints: each silent serving failure is flagged, a good one passes."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from eagle3_hf.publish import check
from eagle3_hf.publish.check import check_drafter

from tests.helpers.drafters import (
    DRAFT_VOCAB,
    HIDDEN,
    VOCAB,
    kimi_k2_config,
    kimi_k2_verifier_config,
    standard_config,
    standard_tensors,
    vocab_mapping,
    write_checkpoint,
    write_drafter,
    write_speculators_drafter,
    write_verifier_config,
)
from tests.helpers.findings import codes


def errors(findings):
    return codes(findings, "error")


@pytest.fixture
def good(tmp_path):
    return write_drafter(tmp_path / "good")


def test_good_checkpoint_passes_clean(good, tmp_path):
    assert check_drafter(good) == []
    assert check_drafter(good, verifier=str(write_verifier_config(tmp_path / "verifier"))) == []


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_good_checkpoint_passes_for_each_engine(good, engine):
    assert check_drafter(good, engine=engine) == []


# -- weight names --------------------------------------------------------------------------------------

def test_speculators_names_are_dropped_by_sglang_only(tmp_path):
    q = "self_attn.q_proj.weight"
    path = write_drafter(tmp_path / "d", rename={f"midlayer.{q}": f"layers.0.{q}"})
    assert "speculators-names" in errors(check_drafter(path, engine="sglang"))
    assert errors(check_drafter(path, engine="vllm")) == set()


def test_model_prefix_is_flagged(tmp_path):
    cfg = standard_config()
    tensors = {("model." + k if k not in ("d2t", "t2d") else k): v for k, v in standard_tensors(cfg).items()}
    found = check_drafter(write_checkpoint(tmp_path / "d", cfg, tensors))
    assert {"unknown-weights", "missing-lm-head", "missing-weights"} <= errors(found)
    assert "model.lm_head.weight" in next(f.message for f in found if f.code == "unknown-weights")


def test_missing_lm_head(tmp_path):
    found = check_drafter(write_drafter(tmp_path / "d", drop=("lm_head.weight",)))
    assert "missing-lm-head" in errors(found)
    assert "random" in next(f.message for f in found if f.code == "missing-lm-head")


def test_missing_layer_weight_and_d2t(tmp_path):
    found = check_drafter(write_drafter(tmp_path / "d", drop=("midlayer.hidden_norm.weight", "d2t")))
    assert {"missing-weights", "missing-d2t"} <= errors(found)


# -- untrained lm_head / embed_tokens ---------------------------------------------------------------------

def test_zero_lm_head_is_an_error(tmp_path):
    path = write_drafter(tmp_path / "d", replace={"lm_head.weight": torch.zeros(DRAFT_VOCAB, HIDDEN)})
    assert "untrained-lm_head" in errors(check_drafter(path))


def test_identical_rows_lm_head_is_an_error(tmp_path):
    path = write_drafter(tmp_path / "d", replace={"lm_head.weight": torch.randn(1, HIDDEN).repeat(DRAFT_VOCAB, 1)})
    assert "untrained-lm_head" in errors(check_drafter(path))


@pytest.mark.parametrize("init", ["hf_normal", "torch_linear"])
def test_init_like_lm_head_is_a_warning(tmp_path, init):
    torch.manual_seed(0)
    if init == "hf_normal":
        head = torch.randn(DRAFT_VOCAB, HIDDEN) * 0.02
    else:
        head = torch.nn.Linear(HIDDEN, DRAFT_VOCAB).weight.data
    found = check_drafter(write_drafter(tmp_path / "d", replace={"lm_head.weight": head}))
    assert codes(found, "warning") == {"untrained-lm_head"} and not errors(found)


def test_trained_looking_heads_do_not_warn(tmp_path):
    # several seeds of the "trained" fixture, and a larger head: no false positives
    for seed in range(5):
        assert check_drafter(write_drafter(tmp_path / f"d{seed}", seed=seed)) == []
    big = standard_config(hidden_size=256, head_dim=64, intermediate_size=256, target_hidden_size=256,
                          draft_vocab_size=400)
    assert check_drafter(write_drafter(tmp_path / "big", config=big)) == []


def test_random_embed_tokens_warns_and_mismatch_with_verifier_is_an_error(tmp_path):
    torch.manual_seed(0)
    random_embed = torch.randn(VOCAB, HIDDEN) * 0.02
    path = write_drafter(tmp_path / "d", replace={"embed_tokens.weight": random_embed})
    assert codes(check_drafter(path), "warning") == {"untrained-embed_tokens"}
    verifier = write_verifier_config(tmp_path / "verifier")
    save_file({"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN)}, str(verifier / "model.safetensors"))
    found = check_drafter(path, verifier=str(verifier))
    assert "embed-differs" in errors(found)
    assert "embed-differs" not in errors(check_drafter(path, verifier=str(verifier), engine="sglang"))
    save_file({"model.embed_tokens.weight": random_embed}, str(verifier / "model.safetensors"))
    assert "embed-shared" in codes(check_drafter(path, verifier=str(verifier)), "info")


# -- d2t / t2d --------------------------------------------------------------------------------------------

def test_d2t_as_absolute_ids(tmp_path):
    d2t, t2d = vocab_mapping()
    kept = d2t + torch.arange(DRAFT_VOCAB)
    found = check_drafter(write_drafter(tmp_path / "d", replace={"d2t": kept}))
    assert "d2t-absolute" in errors(found)
    no_t2d = check_drafter(write_drafter(tmp_path / "e", replace={"d2t": kept}, drop=("t2d",)))
    assert "d2t-range" in errors(no_t2d) and "absolute" in next(f.message for f in no_t2d if f.code == "d2t-range")


def test_t2d_disagreeing_with_d2t(tmp_path):
    _, t2d = vocab_mapping(seed=5)
    assert "d2t-t2d-mismatch" in errors(check_drafter(write_drafter(tmp_path / "d", replace={"t2d": t2d})))


def test_duplicate_targets_and_bad_dtypes(tmp_path):
    d2t, _ = vocab_mapping()
    dup = d2t.clone()
    dup[1] = dup[0] - 1  # draft ids 0 and 1 both land on the same verifier id
    assert "d2t-order" in errors(check_drafter(write_drafter(tmp_path / "d", replace={"d2t": dup})))
    found = check_drafter(write_drafter(tmp_path / "e", replace={"d2t": d2t.float(), "t2d": vocab_mapping()[1].long()}))
    assert "d2t-dtype" in errors(found) and "t2d-dtype" in codes(found, "warning")


# -- aux layer ids ----------------------------------------------------------------------------------------

def test_same_ids_in_both_places_is_off_by_one(tmp_path):
    path = write_drafter(tmp_path / "d", eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5],
                                                       "use_aux_hidden_state": True})
    found = check_drafter(path)
    assert "aux-ids-mismatch" in errors(found)
    assert "off by one" in next(f.message for f in found if f.code == "aux-ids-mismatch")


def test_ids_only_for_one_engine(tmp_path):
    nested = {"eagle_aux_hidden_state_layer_ids": [0, 2, 5], "use_aux_hidden_state": True}
    nested_only = write_drafter(tmp_path / "a", eagle_aux_hidden_state_layer_ids=..., eagle_config=nested)
    assert "aux-ids-vllm" in errors(check_drafter(nested_only))  # vLLM's default (2, 4, 5) != trained (1, 3, 6)
    assert "aux-ids-vllm" not in codes(check_drafter(nested_only, engine="sglang"))
    top_only = write_drafter(tmp_path / "b", eagle_config=..., eagle_aux_hidden_state_layer_ids=[1, 3, 6])
    found = check_drafter(top_only)
    assert "aux-ids-sglang" in errors(found)
    assert "[2, 4, 5]" in next(f.message for f in found if f.code == "aux-ids-sglang")  # says which default
    default_only = write_drafter(tmp_path / "c", eagle_config=..., eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    assert codes(check_drafter(default_only)) == {"aux-ids-sglang"} and not errors(check_drafter(default_only))
    unknown_depth = write_drafter(tmp_path / "e", eagle_config=..., verifier_num_hidden_layers=...)
    assert codes(check_drafter(unknown_depth), "warning") == {"aux-ids-sglang"}


def test_ids_out_of_range_and_missing(tmp_path):
    found = check_drafter(write_drafter(tmp_path / "a", eagle_aux_hidden_state_layer_ids=[0, 4, 8],
                                        eagle_config={"eagle_aux_hidden_state_layer_ids": [-1, 3, 7]}))
    assert "aux-ids-range" in errors(found)
    none = check_drafter(write_drafter(tmp_path / "b", eagle_aux_hidden_state_layer_ids=..., eagle_config=...))
    assert "aux-ids-missing" in codes(none, "warning")
    off = write_drafter(tmp_path / "c", eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4],
                                                      "use_aux_hidden_state": False})
    assert "use-aux-hidden-state" in errors(check_drafter(off))


# -- config -----------------------------------------------------------------------------------------------

def test_norm_before_residual_matters_for_sglang_only(tmp_path):
    path = write_drafter(tmp_path / "d", norm_before_residual=True)
    assert "norm-before-residual" in errors(check_drafter(path, engine="sglang"))
    # vLLM honours the flag: not an error, but a warning, as a drafter trained with false served at τ ≈ 1 there
    assert errors(check_drafter(path, engine="vllm")) == set()
    assert codes(check_drafter(path, engine="vllm"), "warning") == {"norm-before-residual"}


@pytest.mark.parametrize("overrides, level, code", [
    ({"rope_theta": ...}, "warning", "legacy-rope-theta"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "warning", "legacy-rope-scaling"),
    ({"rms_norm_eps": ...}, "warning", "rms-norm-eps"),
    ({"architectures": ["MistralForCausalLM"]}, "error", "architectures"),
    ({"model_type": "mistral"}, "warning", "model-type"),
    ({"draft_vocab_size": ...}, "error", "draft-vocab-size"),
    ({"tie_word_embeddings": True}, "error", "tied-embeddings"),
    ({"num_hidden_layers": 2}, "error", "num-layers"),
])
def test_config_problems(tmp_path, overrides, level, code):
    cfg = standard_config(**overrides)
    found = check_drafter(write_checkpoint(tmp_path / "d", cfg, standard_tensors(standard_config())))
    assert code in codes(found, level), [str(f) for f in found]


def test_sizes_against_the_verifier(good, tmp_path):
    found = check_drafter(good, verifier=str(write_verifier_config(tmp_path / "v", vocab_size=2000, hidden_size=128)))
    assert {"verifier-vocab", "verifier-hidden"} <= errors(found)
    short = check_drafter(good, verifier=str(write_verifier_config(tmp_path / "w", num_hidden_layers=5)))
    assert "aux-ids-range" in errors(short)  # index 5 needs at least 6 layers
    assert "verifier-not-found" in errors(check_drafter(good, verifier=str(tmp_path / "nope")))


@pytest.mark.parametrize("name, shape", [
    ("fc.weight", (HIDDEN, 2 * HIDDEN)),
    ("midlayer.self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
    ("lm_head.weight", (VOCAB, HIDDEN)),
])
def test_shapes_against_config(tmp_path, name, shape):
    found = check_drafter(write_drafter(tmp_path / "d", replace={name: torch.randn(*shape) * 0.05}))
    assert any(f.code == "shape" and name in f.message for f in found)


def test_nan_and_fp16_overflow(tmp_path):
    bad = standard_tensors(standard_config())["fc.weight"].clone()
    bad[0, 0] = math.nan
    assert "non-finite" in errors(check_drafter(write_drafter(tmp_path / "a", replace={"fc.weight": bad})))
    big = bad.nan_to_num(1e5)
    assert "fp16-overflow" in codes(check_drafter(write_drafter(tmp_path / "b", replace={"fc.weight": big})), "warning")
    norm = torch.full((HIDDEN,), 3000.0)
    found = check_drafter(write_drafter(tmp_path / "c", replace={"norm.weight": norm}))
    assert "fp16-overflow" in codes(found, "warning")


def test_missing_files(tmp_path):
    assert errors(check_drafter(tmp_path / "nope")) == {"not-found"}
    (tmp_path / "empty").mkdir()
    assert errors(check_drafter(tmp_path / "empty")) == {"missing-config"}
    (tmp_path / "empty" / "config.json").write_text(json.dumps(standard_config()))
    assert "missing-weights-file" in errors(check_drafter(tmp_path / "empty"))


# -- published shapes -------------------------------------------------------------------------------------

def test_kimi_k2_published_shape_passes(tmp_path):
    cfg = kimi_k2_config()
    path = write_checkpoint(tmp_path / "kimi", cfg, standard_tensors(cfg))
    verifier = kimi_k2_verifier_config(tmp_path / "kimi-verifier")
    for found in (check_drafter(path, engine="sglang"), check_drafter(path, verifier=str(verifier), engine="sglang")):
        assert not errors(found), [str(f) for f in found]
    # SGLang-form ids [1, 29, 57] + 1 == vLLM's default (2, 30, 58) for 61 layers: SGLang (every version) and vLLM
    # before PR 42764 agree, but vLLM since PR 42764 reads eagle_config's [1, 29, 57] as they are: one layer lower
    found = check_drafter(path, verifier=str(verifier))
    assert "aux-ids-vllm" in codes(found, "info")
    assert errors(found) == {"aux-ids-vllm-versions"}
    assert "[1, 29, 57]" in next(f.message for f in found if f.code == "aux-ids-vllm-versions")
    llama_typed = kimi_k2_config(model_type="llama", eagle_aux_hidden_state_layer_ids=[2, 30, 58])
    path = write_checkpoint(tmp_path / "kimi2", llama_typed, standard_tensors(llama_typed))
    # its YaRN carries mscale / mscale_all_dim, which vLLM before 0.30.0 and SGLang before 0.5.16 do not read
    found = check_drafter(path, verifier=str(verifier))
    assert {(f.level, f.code) for f in found} == {("warning", "rope-yarn-versions")} and len(found) == 2
    current = check_drafter(path, verifier=str(verifier), engine_versions={"vllm": "0.32.0", "sglang": "0.5.23"})
    assert {(f.level, f.code) for f in current} == {("info", "rope-yarn-scaling")}


def test_speculators_layout_serves_in_vllm_only(tmp_path):
    path = write_speculators_drafter(tmp_path / "spec")
    assert not errors(check_drafter(path, engine="vllm"))
    assert errors(check_drafter(path, engine="sglang")) == {"speculators-layout"}
    implicit = write_speculators_drafter(tmp_path / "spec2", norm_before_residual=...)
    assert "norm-before-residual" in codes(check_drafter(implicit, engine="vllm"), "warning")


def test_model_class_checkpoint_passes(tmp_path):
    from tests.helpers.drafters import tiny_model

    torch.manual_seed(0)
    model = tiny_model()
    vocab, draft = model.config.vocab_size, model.config.draft_vocab_size
    d2t, t2d = vocab_mapping(vocab, draft)
    model.set_vocab_mapping(d2t, t2d)
    model.save_pretrained(tmp_path / "m")
    found = check_drafter(tmp_path / "m")
    assert not errors(found), [str(f) for f in found]


# -- CLI --------------------------------------------------------------------------------------------------

def test_cli_exit_codes_and_output(good, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    assert check.run(parser.parse_args([str(good)])) == 0
    assert "OK: 0 error(s)" in capsys.readouterr().out
    broken = write_drafter(tmp_path / "broken", drop=("lm_head.weight",))
    assert check.run(parser.parse_args([str(broken), "--engine", "sglang"])) == 1
    out = capsys.readouterr().out
    assert "ERROR   missing-lm-head" in out and "FAILED" in out
    from eagle3_hf.cli import main

    assert main(["check", str(broken), "--json"]) == 1
    assert any(f["code"] == "missing-lm-head" for f in json.loads(capsys.readouterr().out))


def test_constant_rows_rope_mismatch_and_own_embedding_size(tmp_path):
    rows = torch.arange(DRAFT_VOCAB, dtype=torch.float32)[:, None].repeat(1, HIDDEN) * 0.01
    assert "untrained-lm_head" in errors(check_drafter(write_drafter(tmp_path / "a", replace={"lm_head.weight": rows})))
    found = check_drafter(write_drafter(tmp_path / "b", rope_theta=500000.0))
    assert "legacy-rope-theta" in codes(found, "warning")
    cfg = standard_config(target_hidden_size=2 * HIDDEN)
    found = check_drafter(write_checkpoint(tmp_path / "c", cfg, standard_tensors(cfg)))
    assert "missing-embed-tokens" in errors(found) and "target-hidden-size" in codes(found, "warning")


def test_d2t_with_a_full_draft_vocabulary_is_refused_by_vllm(tmp_path):
    """vLLM 0.32 refuses a d2t when draft_vocab_size is the whole vocabulary or missing (it builds no map for
    it): measured by scripts/vllm_broken_exports.py, docs/contracts.md "What vLLM does with broken exports"."""
    full = write_drafter(tmp_path / "full", draft_vocab_size=VOCAB)
    assert "d2t-without-draft-vocab" in errors(check_drafter(full, engine="vllm"))
    assert "d2t-without-draft-vocab" not in codes(check_drafter(full, engine="sglang"))
    missing = write_drafter(tmp_path / "missing", draft_vocab_size=VOCAB)
    cfg = json.loads((missing / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (missing / "config.json").write_text(json.dumps(cfg))
    assert {"draft-vocab-size", "d2t-without-draft-vocab"} <= errors(check_drafter(missing, engine="vllm"))
    no_map = write_drafter(tmp_path / "no_map", draft_vocab_size=VOCAB, drop=("d2t", "t2d"))
    assert "d2t-without-draft-vocab" not in codes(check_drafter(no_map, engine="vllm"))


def test_a_drafter_served_in_another_thinking_mode_is_refused(tmp_path, capsys):
    from eagle3_hf.cli import main

    from tests.helpers.findings import message

    path = write_drafter(tmp_path / "kimi-off", verifier_chat_template_kwargs={"thinking": False})
    assert "thinking-mode" in codes(check_drafter(path), "info")  # unknown server: says what to serve with
    assert """--default-chat-template-kwargs '{"thinking": false}'""" in message(check_drafter(path), "thinking-mode")
    assert "thinking-mode" not in codes(check_drafter(path, served_kwargs={"thinking": False}))
    wrong = check_drafter(path, served_kwargs={"thinking": True})
    assert "thinking-mode" in codes(wrong, "error")
    assert "thinking: trained false, served true" in message(wrong, "thinking-mode")
    assert "thinking-mode" in codes(check_drafter(path, served_kwargs={}), "warning")  # the template's default
    assert main(["check", str(path), "--chat-template-kwargs", '{"thinking": true}']) == 1
    assert "ERROR   thinking-mode" in capsys.readouterr().out
    assert main(["check", str(path), "--chat-template-kwargs", '{"thinking": false}']) == 0
    plain = write_drafter(tmp_path / "plain")  # nothing recorded: nothing to say
    assert "thinking-mode" not in codes(check_drafter(plain, served_kwargs={"thinking": True}))
