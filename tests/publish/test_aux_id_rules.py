"""The engines' aux-id readers, per engine, SGLang target family and release: what each captures, what `check`
says for a verifier of each family (and of none known), and the ids to send SGLang for given indices."""

from __future__ import annotations

import json

import pytest

from eagle3_hf import Eagle3Config
from eagle3_hf.errors import UsageError
from eagle3_hf.publish.aux_id_rules import AUX_ID_READERS, SGLANG_FAMILIES, sglang_family, sglang_ids_to_send
from eagle3_hf.publish.check import check_drafter

from tests.helpers.drafters import (
    KIMI_LAYERS,
    kimi_k2_config,
    kimi_k2_verifier_config,
    standard_tensors,
    write_checkpoint,
    write_drafter,
    write_verifier_config,
)
from tests.helpers.findings import codes, message


def readings(top, nested, n=8):
    return {(r.engine, r.family, r.version.split(" (")[0]): r.read(top, nested, n) for r in AUX_ID_READERS}


def ids(top, nested):
    return {"eagle_aux_hidden_state_layer_ids": top,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": nested, "use_aux_hidden_state": True}}


def test_each_reader_reads_as_its_engine_file_says():
    got = readings([3, 4, 5], [2, 3, 4])
    assert got[("sglang", "llama", "0.5.10-0.5.23")] == [3, 4, 5]  # always + 1
    assert got[("sglang", "deepseek", "0.5.10-0.5.12")] == [3, 4, 5]  # before PR 25454: always + 1
    assert got[("sglang", "deepseek", "0.5.13-0.5.23")] == [2, 3, 4]  # + 1 only when the first id is 1
    assert readings(None, [1, 3, 4])[("sglang", "deepseek", "0.5.13-0.5.23")] == [2, 4, 5]
    assert got[("sglang", "gpt_oss", "0.5.18-0.5.23")] == [3, 4, 5]
    assert readings(None, [2, 4, 8])[("sglang", "gpt_oss", "0.5.18-0.5.23")] == [2, 4, 8]  # the largest is N
    assert readings(None, [2, 4, 8])[("sglang", "gpt_oss", "0.5.10-0.5.15")] == [3, 5, 9]
    assert got[("vllm", "any", "before PR 42764")] == got[("vllm", "any", "since PR 42764")] == [3, 4, 5]
    nested_only = readings(None, [1, 3, 4])
    assert nested_only[("vllm", "any", "before PR 42764")] == [2, 4, 5]  # the default: eagle_config not read
    assert nested_only[("vllm", "any", "since PR 42764")] == [1, 3, 4]  # eagle_config's, as they are
    assert all(v == [2, 4, 5] for v in readings(None, None).values())  # no ids: the default, as given, everywhere
    assert all(r.source for r in AUX_ID_READERS)
    assert {r.family for r in AUX_ID_READERS if r.engine == "sglang"} == set(SGLANG_FAMILIES)


def test_families_by_the_verifiers_architecture():
    assert sglang_family(["LlamaForCausalLM"]) == sglang_family(["Qwen3ForCausalLM"]) == "llama"
    assert sglang_family(["DeepseekV3ForCausalLM"]) == "deepseek"  # DeepSeek-V3 and Kimi-K2
    assert sglang_family(["KimiK25ForConditionalGeneration"]) == "deepseek"
    assert sglang_family(["GptOssForCausalLM"]) == "gpt_oss"
    assert sglang_family(["SomethingNewForCausalLM"]) is None and sglang_family(None) is None


# ---------------------------------------------------------------- check, per verifier family

NON_DEFAULT = ids([3, 4, 5], [2, 3, 4])  # indices (3, 4, 5) of an 8-layer verifier, written as our export writes them


def test_llama_family_reads_every_explicit_id_plus_one(tmp_path):
    path = write_drafter(tmp_path / "d", **NON_DEFAULT)  # records verifier_architectures ['LlamaForCausalLM']
    assert not codes(check_drafter(path), "error")
    assert not codes(check_drafter(path, verifier=str(write_verifier_config(tmp_path / "v"))), "error")
    same = write_drafter(tmp_path / "same", **ids([3, 4, 5], [3, 4, 5]))
    found = check_drafter(same, engine="sglang")
    assert codes(found, "error") == {"aux-ids-mismatch"}
    assert "llama reader reads eagle_config's [3, 4, 5] as [4, 5, 6]" in message(found, "aux-ids-mismatch")
    assert "eagle_config [2, 3, 4]" in message(found, "aux-ids-mismatch")  # the ids that fix it, for this family


def test_deepseek_family_refuses_what_pr_25454_reads_as_other_layers(tmp_path):
    path = write_drafter(tmp_path / "d", **NON_DEFAULT)
    verifier = write_verifier_config(tmp_path / "v", architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2")
    found = check_drafter(path, verifier=str(verifier), engine="sglang")  # --verifier wins over what was recorded
    assert codes(found, "error") == {"aux-ids-sglang-versions"}
    assert "0.5.13-0.5.23 (PR 25454) captures [2, 3, 4]" in message(found, "aux-ids-sglang-versions")
    recorded = write_drafter(tmp_path / "r", verifier_architectures=["KimiK25ForConditionalGeneration"], **NON_DEFAULT)
    assert codes(check_drafter(recorded), "error") == {"aux-ids-sglang-versions"}
    assert not codes(check_drafter(recorded, engine="vllm"), "error")  # vLLM reads the top-level ids: right


def test_unknown_family_errors_only_where_the_families_disagree(tmp_path):
    path = write_drafter(tmp_path / "d", verifier_architectures=..., **NON_DEFAULT)
    found = check_drafter(path)
    assert codes(found, "error") == {"aux-ids-sglang-families"}
    said = message(found, "aux-ids-sglang-families")
    assert "llama 0.5.10-0.5.23 captures [3, 4, 5]" in said
    assert "deepseek 0.5.13-0.5.23 (PR 25454) captures [2, 3, 4]" in said
    unknown = write_verifier_config(tmp_path / "v", architectures=["SomethingNewForCausalLM"])
    assert codes(check_drafter(path, verifier=str(unknown)), "error") == {"aux-ids-sglang-families"}
    default = write_drafter(tmp_path / "default", verifier_architectures=...)  # (2, 4, 5) as [2, 4, 5] + [1, 3, 4]
    assert not codes(check_drafter(default), "error")


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "DeepseekV3ForCausalLM", None])
def test_kimi_depth_default_reads_alike_and_a_non_default_only_for_llama(tmp_path, architecture):
    """61 layers: the default (2, 30, 58) written as eagle_config [1, 29, 57] reads as (2, 30, 58) under every
    rule; (3, 30, 58) written as [2, 29, 57] reads as [2, 29, 57] under PR 25454: off by one for DeepSeek / Kimi."""
    verifier = kimi_k2_verifier_config(tmp_path / "v")
    if architecture:
        cfg = json.loads((verifier / "config.json").read_text())
        (verifier / "config.json").write_text(json.dumps({**cfg, "architectures": [architecture]}))
    else:
        verifier = None
    for name, top in (("default", [2, 30, 58]), ("other", [3, 30, 58])):
        cfg = kimi_k2_config(model_type="llama", verifier_num_hidden_layers=KIMI_LAYERS,
                             **ids(top, [i - 1 for i in top]))
        path = write_checkpoint(tmp_path / name, cfg, standard_tensors(cfg))
        found = codes(check_drafter(path, verifier=str(verifier) if verifier else None, engine="sglang"), "error")
        if name == "default" or architecture == "LlamaForCausalLM":
            assert not found, (name, found)
        else:
            assert found == {"aux-ids-sglang-versions" if architecture else "aux-ids-sglang-families"}


def test_export_records_the_verifiers_architecture_for_check(tmp_path):
    config = Eagle3Config.from_verifier(
        {"architectures": ["KimiK25ForConditionalGeneration"],
         "text_config": {"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 1000, "num_attention_heads": 4}},
        draft_vocab_size=100, aux_hidden_state_indices=[3, 4, 5])
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["verifier_architectures"] == ["KimiK25ForConditionalGeneration"]
    cfg = json.loads((write_drafter(tmp_path / "d") / "config.json").read_text())
    cfg.update({k: saved[k] for k in ("verifier_architectures", "eagle_aux_hidden_state_layer_ids", "eagle_config")})
    path = write_checkpoint(tmp_path / "e", cfg, standard_tensors(cfg))
    assert "aux-ids-sglang-versions" in codes(check_drafter(path), "error")  # its family found without --verifier


# ---------------------------------------------------------------- the ids to send SGLang


@pytest.mark.parametrize("family, indices, sent", [
    ("llama", [3, 30, 58], [2, 29, 57]),
    ("llama", [2, 30, 58], [1, 29, 57]),
    ("deepseek", [2, 30, 58], [1, 29, 57]),  # the first id 1: + 1 in every release
    ("gpt_oss", [3, 12, 21], [2, 11, 20]),
    (None, [2, 30, 58], [1, 29, 57]),  # every family reads the default's ids alike
])
def test_ids_to_send_are_read_back_as_the_indices(family, indices, sent):
    assert sglang_ids_to_send(indices, family, KIMI_LAYERS) == sent
    readers = [r for r in AUX_ID_READERS if r.engine == "sglang" and family in (None, r.family)]
    assert all(r.read(None, sent, KIMI_LAYERS) == indices for r in readers)


def test_ids_to_send_per_release_and_refusals():
    with pytest.raises(UsageError) as err:  # no ids both DeepSeek releases read as (3, 30, 58)
        sglang_ids_to_send([3, 30, 58], "deepseek", KIMI_LAYERS)
    assert "\n" not in str(err.value) and "[3, 30, 58]" in str(err.value)
    assert sglang_ids_to_send([3, 30, 58], "deepseek", KIMI_LAYERS, version="0.5.23") == [3, 30, 58]
    assert sglang_ids_to_send([3, 30, 58], "deepseek", KIMI_LAYERS, version="0.5.12") == [2, 29, 57]
    with pytest.raises(UsageError, match="no SGLang aux-layer ids"):
        sglang_ids_to_send([1, 30, 58], "deepseek", KIMI_LAYERS, version="0.5.23")  # index 1 first: inexpressible
    with pytest.raises(UsageError, match="no SGLang aux-layer ids"):
        sglang_ids_to_send([3, 30, 58], None, KIMI_LAYERS)  # family unknown: Llama and PR 25454 disagree
    with pytest.raises(UsageError, match="unknown SGLang family"):
        sglang_ids_to_send([2, 30, 58], "mamba")
    with pytest.raises(UsageError, match="X.Y.Z"):
        sglang_ids_to_send([2, 30, 58], "llama", version="main")
