"""EAGLE 3.1 (norm_before_fc, fc_norm, norm_output): the config, the model's math as vLLM and speculators compute it,
both layouts written and read back (a speculators-style 3.1 checkpoint built here), decoding through the model's
forward, `--finetune-from` across versions, and what `eagle3-hf check` says per engine version."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.model.checkpoint import config_from_published
from eagle3_hf.publish.check import check_drafter
from eagle3_hf.train.setup import refuse_other_recurrence

from tests.helpers.drafters import (
    AUX,
    DRAFT_VOCAB,
    HIDDEN,
    STANDARD_KEYS,
    packed_batch,
    random_drafter,
    reference_unroll,
    speculators_config,
    standard_config,
    standard_tensors,
    tiny_model,
    write_checkpoint,
    write_drafter,
)
from tests.helpers.findings import codes

OPTIONS = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_output": True},
           {"norm_before_fc": True, "norm_output": True}, {"fc_norm": True, "norm_output": True}]


def keys(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def with_vocab(model):
    kept = torch.arange(0, 2 * DRAFT_VOCAB, 2)
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    model.set_vocab_mapping(kept - torch.arange(DRAFT_VOCAB), t2d)
    return model


def step_logits(model, seed=0):
    ids, aux, pos, doc = packed_batch([[9, 7]], 16, seed=seed)
    return model(ids, aux, pos, doc, ttt_steps=3).logits


# ---------------------------------------------------------------- the config and the math


def test_config_documents_writes_and_refuses_the_pair():
    config = tiny_model(norm_before_fc=True, norm_output=True).config
    assert config.eagle_version == "3.1" and tiny_model().config.eagle_version == "3.0"
    written = config.to_diff_dict()
    assert (written["norm_before_fc"], written["fc_norm"], written["norm_output"]) == (True, False, True)
    with pytest.raises(ValueError, match="norm_before_fc and fc_norm"):
        tiny_model(norm_before_fc=True, fc_norm=True)
    for option in ("norm_before_fc", "fc_norm", "norm_output"):
        assert option in Eagle3Config.__doc__


def test_fc_input_norms_compute_what_vllm_and_speculators_compute():
    """vLLM `combine_hidden_states` / speculators `forward`: input_norm over the 3T concatenation, fc_norm per chunk."""
    aux = torch.randn(2, 5, 3 * HIDDEN) * 7
    before = tiny_model(norm_before_fc=True)
    var = aux.pow(2).mean(-1, keepdim=True)
    want = before.fc(before.input_norm.weight * aux * torch.rsqrt(var + before.config.rms_norm_eps))
    torch.testing.assert_close(before.project_features(aux), want)
    per = tiny_model(fc_norm=True)
    chunks = aux.chunk(3, dim=-1)
    normed = [n.weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + per.config.rms_norm_eps)
              for n, c in zip(per.fc_norm, chunks)]
    torch.testing.assert_close(per.project_features(aux), per.fc(torch.cat(normed, dim=-1)))


def test_norm_output_feeds_the_post_norm_state_back():
    """The next step reads norm(out), the state lm_head reads: in the TTT unroll and in draft_step alike."""
    model = tiny_model(norm_output=True)
    ids, aux, pos, doc = packed_batch([[10]], 10)
    logits, post, _ = model.draft_step(ids[:, 1:], aux[:, :-1], pos[:, :-1])
    model.config.norm_output = False
    logits_pre, pre, _ = model.draft_step(ids[:, 1:], aux[:, :-1], pos[:, :-1])
    torch.testing.assert_close(post, model.norm(pre))  # fed back: post-norm
    torch.testing.assert_close(logits, logits_pre)  # step 0 is the same function; later steps differ
    model.config.norm_output = True
    out = model(ids, aux, pos, doc, ttt_steps=2)
    torch.testing.assert_close(out.hidden_states[0][:, :-1], post, atol=1e-5, rtol=1e-5)
    model.config.norm_output = False
    assert not torch.allclose(model(ids, aux, pos, doc, ttt_steps=2).logits[1], out.logits[1])


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(o))
def test_packed_unroll_equals_incremental_drafting(options):
    """The TTT unroll (training) and draft_step (decoding, as an engine drafts) compute the same 3.1 drafter."""
    model = tiny_model(**options)
    ids, aux, pos, doc = packed_batch([[8, 6]], 14)
    out = model(ids, aux, pos, doc, ttt_steps=3)
    start = 0
    for n in (8, 6):
        ref = reference_unroll(model, ids[0, start:start + n], aux[0, start:start + n], 3)
        for i in range(3):
            valid = out.step_valid[i][0, start:start + n]
            torch.testing.assert_close(out.logits[i][0, start:start + n][valid], ref[i][valid], atol=2e-5, rtol=1e-4)
        start += n


# ---------------------------------------------------------------- decoding goes through the model's forward


@pytest.mark.parametrize("topk", [1, 2])
def test_decoding_with_norm_output_feeds_the_post_norm_state(topk):
    """Chain (topk 1) and tree (topk 2): every drafter state fed back is one the drafter returned, and with
    norm_output that state is norm(out), so the decoders run the 3.1 recurrence; the output stays lossless."""
    from eagle3_hf.decoding import greedy_generate, speculative_decode

    from tests.helpers.verifiers import lively_verifier

    verifier = lively_verifier()
    drafter = random_drafter(verifier, draft_vocab_size=int(verifier.config.vocab_size))
    drafter.config.norm_output = True
    returned, fed = [], []
    inner = drafter.draft_step

    def spy(input_ids, hidden_states, position_ids, *args, **kwargs):
        if hidden_states.shape[-1] == drafter.config.hidden_size:
            fed.append(hidden_states)
        logits, hidden, cache = inner(input_ids, hidden_states, position_ids, *args, **kwargs)
        returned.append(hidden)
        return logits, hidden, cache

    drafter.draft_step = spy
    prompt = list(range(1000, 1010))
    out = speculative_decode(verifier, drafter, prompt, steps=3, topk=topk, max_new_tokens=12, eos_token_id=[])
    assert out.tokens == greedy_generate(verifier, prompt, 12, eos_token_id=[]).tokens
    assert fed
    norm_weight = drafter.norm.weight.detach()
    seen = [r for h in returned for r in h.reshape(-1, h.shape[-1])]
    for state in fed:
        rows = state.reshape(-1, state.shape[-1])
        assert all(any(torch.equal(row, r) for r in seen) for row in rows)
        # a post-norm row has RMS equal to the norm weight's scale (all ones here): far from a raw residual
        torch.testing.assert_close((rows / norm_weight).pow(2).mean(-1), torch.ones(rows.shape[0]), atol=1e-3,
                                   rtol=1e-3)


# ---------------------------------------------------------------- both layouts, written and read back


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "+".join(o))
def test_standard_and_speculators_exports_carry_the_options(tmp_path, options):
    model = with_vocab(tiny_model(**options))
    model.save_pretrained(tmp_path / "std")
    extra = ({"input_norm.weight"} if options.get("norm_before_fc") else set()) | (
        {f"fc_norm.{i}.weight" for i in range(3)} if options.get("fc_norm") else set())
    assert keys(tmp_path / "std") == STANDARD_KEYS | extra
    std_cfg = json.loads((tmp_path / "std" / "config.json").read_text())
    spec_dir = model.save_speculators(tmp_path / "spec")
    spec_cfg = json.loads((spec_dir / "config.json").read_text())
    for option in ("norm_before_fc", "fc_norm", "norm_output"):
        assert std_cfg[option] is spec_cfg[option] is bool(options.get(option))  # the keys vLLM reads
    assert extra <= keys(spec_dir)  # speculators names them the same: input_norm.weight, fc_norm.{i}.weight
    std = Eagle3DraftModel.from_pretrained(tmp_path / "std", verifier=model)
    spec = Eagle3DraftModel.from_pretrained(spec_dir)
    for loaded in (std, spec):
        assert loaded.config.eagle31_options() == model.config.eagle31_options()
        for a, b in zip(step_logits(model), step_logits(loaded)):
            assert torch.equal(a, b)
    assert not codes(check_drafter(tmp_path / "std", engine="vllm"), "error")


def test_a_speculators_31_checkpoint_reads_with_its_recurrence(tmp_path):
    """Built by hand as speculators writes it (no class of ours): layers.0.* names, input_norm.weight, the
    three options at the top level; read back as a 3.1 drafter whose fc input and recurrence are the 3.1 ones."""
    cfg = speculators_config(norm_before_fc=True, fc_norm=False, norm_output=True)
    written = standard_tensors(standard_config(), embed=True)
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in written.items()}
    tensors["input_norm.weight"] = torch.linspace(0.5, 1.5, 3 * HIDDEN)
    path = write_checkpoint(tmp_path / "spec31", cfg, tensors)
    model = Eagle3DraftModel.from_pretrained(path)
    assert model.config.norm_before_fc and model.config.norm_output and not model.config.fc_norm
    assert torch.equal(model.input_norm.weight, tensors["input_norm.weight"])
    assert model.config.aux_hidden_state_indices == AUX
    del tensors["input_norm.weight"]  # the option without its weight: refused, naming it
    with pytest.raises(ValueError, match="input_norm.weight"):
        Eagle3DraftModel.from_pretrained(write_checkpoint(tmp_path / "noweight", cfg, tensors))


def test_standard_configs_published_by_others_keep_norm_output(tmp_path):
    """norm_output carries no weight: only the config says the recurrence, and it is read (it used to be ignored)."""
    cfg = config_from_published(standard_config(norm_output=True), {})
    assert cfg.norm_output and cfg.eagle_version == "3.1"
    nested = standard_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "norm_before_fc": True})
    assert config_from_published(nested, {}).norm_before_fc  # vLLM reads eagle_config's key first


# ---------------------------------------------------------------- --finetune-from across versions


def test_finetune_from_another_eagle_version_is_refused_in_one_line():
    source, target = tiny_model(norm_before_fc=True, norm_output=True).config, tiny_model().config
    with pytest.raises(ValueError) as refused:
        refuse_other_recurrence("org/drafter", source, target)
    message = str(refused.value)
    assert "\n" not in message and "EAGLE 3.1" in message and "--norm-before-fc --norm-output" in message
    with pytest.raises(ValueError, match="EAGLE 3.0 and this run EAGLE 3.1"):
        refuse_other_recurrence("org/drafter", target, source)
    refuse_other_recurrence("org/drafter", source, tiny_model(norm_before_fc=True, norm_output=True).config)


def test_train_flags_reach_the_drafter():
    from transformers import HfArgumentParser, LlamaConfig

    from eagle3_hf.train.arguments import ModelArguments
    from eagle3_hf.train.setup import build_drafter

    (args,) = HfArgumentParser(ModelArguments).parse_args_into_dataclasses(["--norm-before-fc", "--norm-output"])
    verifier = LlamaConfig(vocab_size=1000, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=8,
                           num_attention_heads=4, num_key_value_heads=2)
    d2t = torch.zeros(1000, dtype=torch.long)
    model, _ = build_drafter(args, verifier, d2t, torch.ones(1000, dtype=torch.bool), AUX, None)
    assert model.config.eagle31_options() == {"norm_before_fc": True, "fc_norm": False, "norm_output": True}
    assert model.input_norm is not None


# ---------------------------------------------------------------- what check says per engine version


def test_check_names_the_engine_versions_of_each_option(tmp_path):
    tensors = standard_tensors(standard_config())
    before = write_checkpoint(tmp_path / "nbf", standard_config(norm_before_fc=True),
                              {**tensors, "input_norm.weight": torch.ones(3 * HIDDEN)})
    sglang = check_drafter(before, engine="sglang")
    assert not codes(sglang, "error") and "0.5.17" in next(f.message for f in sglang
                                                           if f.code == "norm-before-fc-versions")
    vllm = check_drafter(before, engine="vllm")
    assert not codes(vllm, "error") and "norm-before-fc-versions" in codes(vllm, "warning")
    assert "PR 36545" in next(f.message for f in vllm if f.code == "norm-before-fc-versions")
    out = write_drafter(tmp_path / "no", norm_output=True)
    for engine, pr in (("sglang", "PR 24663"), ("vllm", "PR 42764")):
        found = check_drafter(out, engine=engine)
        assert not codes(found, "error")
        assert pr in next(f.message for f in found if f.code == "norm-output-versions")
    per = write_checkpoint(tmp_path / "fcn", standard_config(fc_norm=True),
                           {**tensors, **{f"fc_norm.{i}.weight": torch.ones(HIDDEN) for i in range(3)}})
    assert not codes(check_drafter(per), "error") and "fc-norm-versions" in codes(check_drafter(per), "warning")


def test_check_refuses_weights_without_their_option_and_split_keys(tmp_path):
    stray = write_drafter(tmp_path / "stray", replace={"input_norm.weight": torch.ones(3 * HIDDEN)})
    assert "eagle31-weights-without-option" in codes(check_drafter(stray), "error")
    missing = write_drafter(tmp_path / "missing", fc_norm=True)
    assert "missing-weights" in codes(check_drafter(missing), "error")
    split = write_drafter(tmp_path / "split", norm_before_fc=False, eagle_config={
        "eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True, "norm_before_fc": True},
        replace={"input_norm.weight": torch.ones(3 * HIDDEN)})
    assert "norm-before-fc-keys" in codes(check_drafter(split, engine="vllm"), "error")


# ---------------------------------------------------------------- aux ids (readers: tests/publish/test_aux_id_rules.py)


def test_our_default_export_reads_alike_in_every_version(tmp_path):
    model = with_vocab(tiny_model(norm_output=True))
    assert model.config.aux_hidden_state_indices == AUX  # (2, N//2, N-3) for the 8-layer verifier
    model.save_pretrained(tmp_path)
    found = codes(check_drafter(tmp_path))  # the verifier's family unknown: every SGLang family's reader runs
    assert not {c for c in found if c.startswith("aux") and c.endswith(("-versions", "-families"))}
