"""`eagle3-hf check` on a DFlash drafter: ours passes; each way the engines would serve another model is an error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle3_hf.model.configuration_dflash import DFlashConfig
from eagle3_hf.model.modeling_dflash import DFlashDraftModel
from eagle3_hf.publish.check import check_drafter


@pytest.fixture()
def saved(tmp_path):
    verifier = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2)
    config = DFlashConfig.from_verifier(verifier, mask_token_id=96, num_hidden_layers=2, block_size=5)
    torch.manual_seed(0)
    DFlashDraftModel(config).save_pretrained(tmp_path / "d")
    verifier.save_pretrained(tmp_path / "v")
    return tmp_path / "d", tmp_path / "v"


def codes(path, verifier=None, level="error"):
    return {f.code for f in check_drafter(path, verifier=str(verifier) if verifier else None, engine="all")
            if f.level == level}


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_our_export_passes_and_says_how_many_tokens_to_draft(saved):
    drafter, verifier = saved
    assert codes(drafter, verifier) == set() and codes(drafter, verifier, "warning") == set()


@pytest.mark.parametrize("changes, code", [
    ({"head_dim": None}, "dflash-head-dim"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, "dflash-aux-ids-mismatch"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "dflash-aux-ids-mismatch"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "dflash-causal"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 7], "mask_token_id": 96, "block_size": 5}}, "aux-ids-range"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 4], "block_size": 5}}, "dflash-mask-token"),
    ({"dflash_config": {"target_layer_ids": [1, 3, 4], "mask_token_id": 97, "block_size": 5}}, "dflash-mask-token"),
])
def test_each_config_the_engines_would_misread_is_an_error(saved, changes, code):
    drafter, verifier = saved
    edit_config(drafter, **changes)
    assert code in codes(drafter, verifier)


def test_a_missing_rope_theta_is_a_warning(saved):  # every engine then takes 1e4 (docs/contracts.md)
    drafter, verifier = saved
    edit_config(drafter, rope_theta=None, rope_parameters=None)
    assert "dflash-rope-theta" in codes(drafter, verifier, "warning")


def test_a_misnamed_or_extra_tensor_is_an_error(saved):
    drafter, verifier = saved
    tensors = load_file(str(drafter / "model.safetensors"))
    tensors["layers.1.self_attn.qkv_proj.weight"] = tensors.pop("layers.1.self_attn.q_proj.weight")
    tensors["lm_head.weight"] = torch.zeros(10, 64)
    save_file(tensors, str(drafter / "model.safetensors"))
    found = {f.code: f.message for f in check_drafter(drafter, verifier=str(verifier))}
    assert "qkv_proj" in found["unknown-weights"] and "layers.1.self_attn.q_proj.weight" in found["missing-weights"]
    assert "lm_head" in found["dflash-verifier-parts"]
