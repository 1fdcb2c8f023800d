"""`norm_before_residual` (speculators' training default): `train --norm-before-residual` builds it, both layouts
write it where vLLM reads it, the layer computes what that flag means, and `check` and the model card say that
SGLang serves such a drafter with the wrong math."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.cli import main as cli
from eagle3_hf.publish.check import check_drafter
from eagle3_hf.publish.model_card import build_model_card
from eagle3_hf.train.setup import refuse_other_recurrence

from tests.helpers.drafters import AUX, HIDDEN, packed_batch, tiny_model, write_drafter


def step_logits(model):
    ids, aux, pos, doc = packed_batch([[9, 7]], 16, seed=1)
    with torch.no_grad():
        return model(ids, aux, pos, doc, ttt_steps=3).logits


def test_the_train_flag_reaches_both_layouts_where_vllm_reads_it(tmp_path):
    from transformers import HfArgumentParser, LlamaConfig

    from eagle3_hf.train.arguments import ModelArguments
    from eagle3_hf.train.setup import build_drafter

    (args,) = HfArgumentParser(ModelArguments).parse_args_into_dataclasses(["--norm-before-residual"])
    verifier = LlamaConfig(vocab_size=1000, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2)
    model, _ = build_drafter(args, verifier, torch.zeros(1000, dtype=torch.long), torch.ones(1000, dtype=torch.bool),
                             AUX, None)
    assert model.config.norm_before_residual
    (default,) = HfArgumentParser(ModelArguments).parse_args_into_dataclasses([])
    assert default.norm_before_residual is False

    model = tiny_model(norm_before_residual=True)
    model.save_pretrained(tmp_path / "std")
    spec = model.save_speculators(tmp_path / "spec")
    for path in (tmp_path / "std", spec):
        assert json.loads((path / "config.json").read_text())["norm_before_residual"] is True  # top level
    # the standard layout needs the verifier's embedding from elsewhere; the speculators one carries it
    for loaded in (Eagle3DraftModel.from_pretrained(tmp_path / "std", verifier=model),
                   Eagle3DraftModel.from_pretrained(spec)):
        assert loaded.config.norm_before_residual
        for a, b in zip(step_logits(model), step_logits(loaded)):
            assert torch.equal(a, b)


def test_with_the_normed_residual_norm_before_fc_is_a_reparametrised_eagle30():
    """The layer reads and adds hidden_norm(h) only, and RMSNorm ignores scale: `input_norm` (weight w) before
    fc equals a 3.0 drafter whose fc is fc · diag(w), at every step. With the un-normed residual it does not."""
    for residual_normed in (True, False):
        nbf = tiny_model(norm_before_residual=residual_normed, norm_before_fc=True)
        plain = tiny_model(norm_before_residual=residual_normed)
        state = {k: v for k, v in nbf.state_dict().items() if not k.startswith("input_norm")}
        state["fc.weight"] = nbf.fc.weight * nbf.input_norm.weight  # [H, 3T] * [3T]: fc · diag(w)
        plain.load_state_dict(state)
        pairs = list(zip(step_logits(nbf), step_logits(plain)))
        if residual_normed:
            for a, b in pairs:
                torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
        else:
            assert not torch.allclose(pairs[0][0], pairs[0][1], atol=1e-3)


def test_check_refuses_it_for_sglang_and_warns_for_vllm(tmp_path, capsys):
    path = write_drafter(tmp_path / "d", norm_before_residual=True)
    sglang = [f for f in check_drafter(path, engine="sglang") if f.code == "norm-before-residual"]
    assert [f.level for f in sglang] == ["error"]
    assert "0.5.23" in sglang[0].message and "python/sglang/srt/models/llama_eagle3.py" in sglang[0].message
    vllm = check_drafter(path, engine="vllm")
    assert not [f for f in vllm if f.level == "error"]
    warning = next(f.message for f in vllm if f.code == "norm-before-residual")
    assert "0.32.0" in warning and "--norm-before-residual" in warning
    assert cli(["check", str(path), "--engine", "sglang"]) == 1
    assert cli(["check", str(path), "--engine", "vllm"]) == 0
    assert "norm-before-residual" in capsys.readouterr().out
    plain = write_drafter(tmp_path / "plain")
    assert not [f for f in check_drafter(plain) if f.code == "norm-before-residual"]


def test_finetuning_across_the_residual_is_refused_naming_the_flag():
    source, run = tiny_model(norm_before_residual=True).config, tiny_model().config
    with pytest.raises(ValueError) as refused:
        refuse_other_recurrence("org/drafter", source, run)
    message = str(refused.value)
    assert "\n" not in message and "norm_before_residual True (this run False)" in message
    assert "pass --norm-before-residual of" in message
    refuse_other_recurrence("org/drafter", source, tiny_model(norm_before_residual=True).config)


def test_the_model_card_says_sglang_serves_it_wrongly(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "draft_vocab_size": 32, "vocab_size": 128}
    for name, extra in (("plain", {}), ("normed", {"norm_before_residual": True})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    assert "norm_before_residual" not in build_model_card(tmp_path / "plain").text
    text = build_model_card(tmp_path / "normed").text
    assert "(`norm_before_residual`, speculators' training default): vLLM serves it; SGLang" in text
    assert "`eagle3-hf check --engine sglang` refuses it" in text
