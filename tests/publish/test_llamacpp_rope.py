"""llama.cpp's RoPE for the drafters of the five reference verifiers (Kimi-K2.5, DeepSeek-V3, Llama-3.1, Qwen3,
Gemma 3), computed as its source does (tests/helpers/llamacpp_rope.py), against transformers': equal for the three
that are not YaRN, and `check --engine llamacpp` refuses the two YaRN ones in one line citing llama.cpp's files. The
source facts the computation rests on are read from the tree `make llamacpp` unpacks (skipped without it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from eagle3_hf.engines.llamacpp_env import LlamaCpp, llamacpp_dir
from eagle3_hf.model.configuration_eagle3 import Eagle3Config
from eagle3_hf.publish.check import check_drafter

from tests.helpers.drafters import standard_tensors, write_checkpoint
from tests.helpers.findings import codes, message
from tests.helpers.llamacpp_rope import llamacpp_rope
from tests.helpers.verifier_rope_configs import verifier_text_configs

EQUAL, REFUSED = ("llama31", "qwen3", "gemma3"), ("kimi_k25", "deepseek_v3")


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, Path]:
    root, configs = tmp_path_factory.mktemp("llamacpp_rope"), verifier_text_configs()
    out = {}
    for family in EQUAL + REFUSED:
        config = Eagle3Config.from_verifier(configs[family], draft_vocab_size=256, hidden_size=256,
                                            target_hidden_size=256, intermediate_size=512, num_attention_heads=2,
                                            num_key_value_heads=2, vocab_size=1024)
        cfg = config.to_dict()
        out[family] = write_checkpoint(root / family, cfg, standard_tensors(cfg))
    return out


def transformers_rope(path: Path) -> tuple[float, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(Eagle3Config.from_pretrained(path))
    return float(rotary.attention_scaling), rotary.inv_freq.double()


def _both(path: Path) -> tuple[tuple[float, torch.Tensor], tuple[float, torch.Tensor]]:
    scaling, angles = llamacpp_rope(json.loads((path / "config.json").read_text()))
    return transformers_rope(path), (scaling, torch.tensor(angles, dtype=torch.float64))


@pytest.mark.parametrize("family", EQUAL)
def test_llamacpp_computes_the_rope_training_used(drafters, family):
    (t_scale, t_freq), (l_scale, l_freq) = _both(drafters[family])
    assert l_scale == pytest.approx(t_scale, rel=1e-12)
    torch.testing.assert_close(l_freq, t_freq, rtol=1e-6, atol=0)  # transformers' are fp32
    found = check_drafter(drafters[family], engine="llamacpp")
    assert "llamacpp-rope" not in codes(found)


@pytest.mark.parametrize("family, scaling, freqs_equal", [("kimi_k25", 0.1 * torch.log(torch.tensor(64.0)) + 1,
                                                           False), ("deepseek_v3", 0.1 * torch.log(torch.tensor(40.0))
                                                                    + 1, True)])
def test_a_yarn_drafter_llamacpp_computes_otherwise_is_refused(drafters, family, scaling, freqs_equal):
    """Kimi-K2.5: scaling 1.416 for 1.0 and other frequencies (beta_fast 1 is not read: 32); DeepSeek-V3: the same
    frequencies (its betas are llama.cpp's defaults), scaling 1.369 for 1.0."""
    (t_scale, t_freq), (l_scale, l_freq) = _both(drafters[family])
    assert t_scale == 1.0 and l_scale == pytest.approx(float(scaling), rel=1e-6)
    assert torch.allclose(l_freq, t_freq, rtol=1e-6, atol=0) is freqs_equal
    found = check_drafter(drafters[family], engine="llamacpp")
    assert "llamacpp-rope" in codes(found, "error")
    said = message(found, "llamacpp-rope")
    assert f"attention scaling {float(scaling):.3f}" in said and "src/llama-context.cpp" in said
    assert ("beta_fast 32" in said) is (not freqs_equal)
    assert "llamacpp-rope" not in codes(check_drafter(drafters[family]))  # llama.cpp's alone, asked by name


def test_the_source_says_what_the_computation_assumes():
    tree = LlamaCpp(llamacpp_dir()).tree
    if not (tree / "src" / "models" / "eagle3.cpp").is_file():
        pytest.skip(f"llama.cpp's source is not in {tree}: `make llamacpp` unpacks it")
    base = (tree / "conversion" / "base.py").read_text()
    assert re.search(r"#\s*self\.gguf_writer\.add_rope_scaling_yarn_log_mul", base)  # mscale_all_dim: not written
    assert "mscale" not in re.sub(r"#.*", "", base.split("def set_gguf_parameters")[2].split("\n    def ")[0])
    eagle3 = (tree / "src" / "models" / "eagle3.cpp").read_text()
    assert "YARN" not in eagle3 and "rope_freqs" in eagle3  # no YaRN key read; llama3's divisors used
    hparams = (tree / "src" / "llama-hparams.h").read_text()
    assert re.search(r"yarn_beta_fast\s*=\s*32\.0f", hparams) and re.search(r"yarn_beta_slow\s*=\s*1\.0f", hparams)
    context = (tree / "src" / "llama-context.cpp").read_text()
    assert "cparams.yarn_attn_factor = get_mscale(factor, 1.0f);" in context
    assert "cparams.yarn_attn_factor *= 1.0f / (1.0f + 0.1f * logf(factor));" in context
    ops = (tree / "ggml" / "src" / "ggml-cpu" / "ops.cpp").read_text()
    assert "mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale);" in ops
    ggml = (tree / "ggml" / "src" / "ggml.c").read_text()
    assert "floorf(ggml_rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base))" in ggml
