"""The drafter's RoPE is the same in training and serving: transformers' against each engine's own code, for
drafters made from the Kimi-K2.5, DeepSeek-V3, Llama-3.1, Qwen3 and Gemma 3 verifier configs
(tests/helpers/verifier_rope_configs.py), and `check`'s RoPE rule agreeing with what the installed engines compute.

The engines run in the vLLM venv (`make vllm`; SGLang's wheel unpacked by `make sglang-rope`), one process per engine
for every drafter (20 to 45 s each on two busy cores; the module 46 s): tests/helpers/engine_rope.py. Measured:
attention scaling equal, cos/sin and rotated q, k bit-identical at every position tried (0 to the context's end),
inverse frequencies (recovered from the engines' cos/sin rows) within 1.2e-7 relative. llama.cpp: not an engine
here yet.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eagle3_hf.model.configuration_eagle3 import Eagle3Config
from eagle3_hf.publish.check import check_drafter
from eagle3_hf.publish.rope_rules import YARN_READERS, version_tuple, yarn_parameters

from tests.helpers.drafters import standard_tensors, write_checkpoint
from tests.helpers.engine_rope import ENGINES, assert_same_rope, compare
from tests.helpers.verifier_rope_configs import verifier_text_configs

FAMILIES = ("kimi_k25", "deepseek_v3", "llama31", "qwen3", "gemma3")
# variants of Kimi-K2.5's YaRN: without its mscale keys (plain YaRN, 1.416), and with an explicit attention_factor
# instead (poolside/Laguna-XS.2's way of asking for 1.0), which transformers and vLLM 0.30+ read and SGLang does not
VARIANTS = {"yarn_plain": {"mscale": None, "mscale_all_dim": None},
            "yarn_attention_factor": {"mscale": None, "mscale_all_dim": None, "attention_factor": 1.0}}


def _export(path: Path, verifier: dict) -> Path:
    """The drafter config `from_verifier` gives this verifier, exported with weights so that `check` reads it all."""
    config = Eagle3Config.from_verifier(verifier, draft_vocab_size=256, hidden_size=256, target_hidden_size=256,
                                        intermediate_size=512, num_attention_heads=2, num_key_value_heads=2,
                                        vocab_size=1024)
    cfg = config.to_dict()
    return write_checkpoint(path, cfg, standard_tensors(cfg))


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rope")
    configs = verifier_text_configs()
    out = {family: _export(root / family, configs[family]) for family in FAMILIES}
    for name, change in VARIANTS.items():
        kimi = dict(configs["kimi_k25"])
        scaling = {**kimi["rope_scaling"], **change}
        kimi["rope_scaling"] = {k: v for k, v in scaling.items() if v is not None}
        out[name] = _export(root / name, kimi)
    return out


@pytest.fixture(scope="module")
def computed(drafters) -> dict[str, tuple[str, dict]]:
    """engine -> (its version, {drafter name: (transformers' RoPE, the engine's)})."""
    return {engine: compare(engine, drafters) for engine in ENGINES}


def test_the_drafters_keep_their_verifiers_rope(drafters):
    """What is compared is what export writes for these verifiers: head_dim 128, no partial rotary, the RoPE kept."""
    cfg = {name: json.loads((path / "config.json").read_text()) for name, path in drafters.items()}
    assert all(c["head_dim"] == 128 and "partial_rotary_factor" not in c for c in cfg.values())
    assert yarn_parameters(cfg["kimi_k25"])["mscale_all_dim"] == 1.0 and cfg["kimi_k25"]["rope_theta"] == 50000.0
    assert yarn_parameters(cfg["deepseek_v3"])["factor"] == 40 and cfg["deepseek_v3"]["rope_theta"] == 10000
    assert cfg["llama31"]["rope_scaling"]["rope_type"] == "llama3" and cfg["qwen3"]["rope_scaling"] is None
    assert cfg["gemma3"]["rope_parameters"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", ENGINES)
def test_the_engine_computes_the_rope_training_used(computed, engine):
    version, pairs = computed[engine]
    for name in FAMILIES:
        ours, theirs = pairs[name]
        assert_same_rope(ours, theirs, f"{engine} {version} on the {name} drafter")
    assert pairs["kimi_k25"][1].scaling == 1.0  # mscale / mscale_all_dim, not 0.1·ln 64 + 1
    assert math.isclose(pairs["yarn_plain"][1].scaling, 0.1 * math.log(64) + 1, rel_tol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_different_rope_fails_the_comparison(computed):
    """The comparison can fail: transformers' Kimi RoPE against an engine's for the same YaRN without mscale keys."""
    ours = computed["vllm"][1]["kimi_k25"][0]
    theirs = computed["vllm"][1]["yarn_plain"][1]
    with pytest.raises(AssertionError, match="attention scaling"):
        assert_same_rope(ours, theirs, "vllm")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("engine", ENGINES)
def test_check_says_what_the_installed_engine_computes(computed, drafters, engine):
    """`check` against the installed release refuses exactly the drafters whose RoPE that release computes
    differently from transformers (SGLang 0.5.23: the one with attention_factor), and its table's YaRN scaling for
    that release is the engine's own."""
    version, pairs = computed[engine]
    reader = next(r for r in YARN_READERS if r.engine == engine and r.covers(version_tuple(version)))
    differ, refused = set(), set()
    for name, (ours, theirs) in pairs.items():
        try:
            assert_same_rope(ours, theirs, name)
        except AssertionError:
            differ.add(name)
        found = check_drafter(drafters[name], engine=engine, engine_versions={engine: version})
        if [f for f in found if f.code == "rope-yarn-scaling" and f.level == "error"]:
            refused.add(name)
        params = yarn_parameters(json.loads((drafters[name] / "config.json").read_text()))
        if params is not None:
            assert math.isclose(reader.scaling(params), theirs.scaling, rel_tol=1e-6), (engine, name)
    assert differ == refused == ({"yarn_attention_factor"} if engine == "sglang" else set()), (engine, version)
