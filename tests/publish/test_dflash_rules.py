"""`eagle3-hf check` on a DFlash drafter (publish/dflash_rules.py): a checkpoint in the engines' layout passes for
every engine, and each way the engines would read it differently is one finding, for the engines it concerns."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf.cli import main
from eagle3_hf.publish.check import check_drafter

from tests.helpers.dflash_drafters import write_dflash_drafter
from tests.helpers.drafters import HEADS, HIDDEN, INTER, VERIFIER_LAYERS, VOCAB, write_verifier_config

VERIFIER = {"hidden_size": HIDDEN, "num_hidden_layers": VERIFIER_LAYERS, "vocab_size": VOCAB,
            "num_attention_heads": HEADS, "intermediate_size": INTER}


def codes(findings, level="error"):
    return sorted({f.code for f in findings if f.level == level})


@pytest.fixture
def verifier(tmp_path):
    return write_verifier_config(tmp_path / "verifier")


def test_a_drafter_in_the_engines_layout_passes_for_every_engine(tmp_path, verifier, capsys):
    drafter = write_dflash_drafter(tmp_path / "d", VERIFIER)
    for engine in ("sglang", "vllm", "llamacpp"):
        assert check_drafter(drafter, verifier=str(verifier), engine=engine) == []
    assert main(["check", str(drafter), "--verifier", str(verifier), "--engine", "all"]) == 0
    assert "OK: 0 error(s), 0 warning(s)" in capsys.readouterr().out


@pytest.mark.parametrize("config, code, engines", [
    ({"dflash_config": {"target_layer_ids": [1, 3, 4]}}, "dflash-mask-token", {"sglang", "vllm", "llamacpp"}),
    ({"dflash_config": {"mask_token_id": VOCAB, "target_layer_ids": [1, 3, 4]}}, "dflash-mask-token",
     {"sglang", "vllm", "llamacpp"}),
    ({"dflash_config": {"mask_token_id": 5}}, "dflash-aux-ids", {"sglang", "vllm", "llamacpp"}),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3, VERIFIER_LAYERS - 1]}}, "aux-ids-range",
     {"sglang", "vllm", "llamacpp"}),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "dflash-aux-ids-mismatch", {"vllm"}),
    ({"model_type": "llama"}, "dflash-model-type", {"sglang", "vllm", "llamacpp"}),
    ({"is_causal": True}, "dflash-causal", {"sglang", "vllm", "llamacpp"}),
    ({"layer_types": ["sliding_attention"]}, "dflash-causal", {"sglang", "vllm", "llamacpp"}),
    ({"head_dim": None}, "dflash-head-dim", {"sglang", "vllm", "llamacpp"}),
])
def test_each_config_fault_is_an_error_for_the_engines_it_misleads(tmp_path, verifier, config, code, engines):
    drafter = write_dflash_drafter(tmp_path / "d", VERIFIER, aux=[2, 4, 5], **config)
    if config.get("head_dim", 0) is None:  # written as null: drop the key, as a config without it reads
        cfg = json.loads((drafter / "config.json").read_text())
        del cfg["head_dim"]
        (drafter / "config.json").write_text(json.dumps(cfg))
    for engine in ("sglang", "vllm", "llamacpp"):
        found = codes(check_drafter(drafter, verifier=str(verifier), engine=engine))
        assert (code in found) == (engine in engines), (engine, found)


def test_top_level_ids_that_agree_are_no_fault(tmp_path, verifier):
    drafter = write_dflash_drafter(tmp_path / "d", VERIFIER, aux=[2, 4, 5], eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    assert check_drafter(drafter, verifier=str(verifier), engine="vllm") == []


def test_a_hidden_size_other_than_the_verifier_s_is_refused(tmp_path):
    verifier = write_verifier_config(tmp_path / "v", hidden_size=2 * HIDDEN)
    drafter = write_dflash_drafter(tmp_path / "d", VERIFIER)
    assert "dflash-hidden-size" in codes(check_drafter(drafter, verifier=str(verifier), engine="llamacpp"))


def test_no_block_size_warns_for_the_engines_that_assume_16(tmp_path, verifier):
    drafter = write_dflash_drafter(tmp_path / "d", VERIFIER)
    cfg = json.loads((drafter / "config.json").read_text())
    del cfg["block_size"], cfg["dflash_config"]["block_size"]
    (drafter / "config.json").write_text(json.dumps(cfg))
    assert codes(check_drafter(drafter, verifier=str(verifier), engine="vllm"), "warning") == []
    for engine in ("sglang", "llamacpp"):
        assert codes(check_drafter(drafter, verifier=str(verifier), engine=engine), "warning") == ["dflash-block-size"]


def test_weights_outside_the_layout(tmp_path, verifier):
    head = {"lm_head.weight": torch.zeros(VOCAB, HIDDEN)}
    found = check_drafter(write_dflash_drafter(tmp_path / "h", VERIFIER, extra=head), verifier=str(verifier))
    assert codes(found) == ["dflash-verifier-parts"]
    d2t = {"d2t": torch.zeros(10, dtype=torch.int64)}
    found = check_drafter(write_dflash_drafter(tmp_path / "v", VERIFIER, extra=d2t), verifier=str(verifier),
                          engine="llamacpp")
    assert codes(found) == ["dflash-verifier-parts"]
    typo = {"layers.0.self_attn.q_norms.weight": torch.ones(HIDDEN // HEADS)}
    found = check_drafter(write_dflash_drafter(tmp_path / "t", VERIFIER, extra=typo), verifier=str(verifier),
                          engine="sglang")
    assert codes(found) == ["unknown-weights"]


def test_names_with_model_prefix_and_missing_or_misshapen_weights(tmp_path, verifier):
    drafter = write_dflash_drafter(tmp_path / "d", VERIFIER)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(drafter / "model.safetensors"))
    save_file({f"model.{k}": v for k, v in tensors.items()}, str(drafter / "model.safetensors"))
    assert codes(check_drafter(drafter, verifier=str(verifier), engine="vllm")) == ["dflash-model-prefix"]
    assert check_drafter(drafter, verifier=str(verifier), engine="llamacpp") == []  # it takes either spelling
    tensors.pop("hidden_norm.weight")
    tensors["fc.weight"] = tensors["fc.weight"][:, :HIDDEN].contiguous()  # one aux state where the config names three
    save_file(tensors, str(drafter / "model.safetensors"))
    assert codes(check_drafter(drafter, verifier=str(verifier), engine="sglang")) == ["missing-weights", "shape"]
