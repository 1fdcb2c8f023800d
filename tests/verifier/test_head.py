"""load_verifier_head reads only the final norm and lm_head: by tensor name through the safetensors index, from a
directory or the Hub, without building the model (so nested multimodal configs need no class of their own)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf.verifier.capture import final_norm, greedy_tokens
from eagle3_hf.verifier.head import load_verifier_head

from tests.helpers.families import FAMILIES, family_model
from tests.helpers.hub_server import WRITE_TOKEN, client_pointed_at


@pytest.mark.parametrize("family", FAMILIES)
def test_head_equals_the_models_own(family, tmp_path):
    model = family_model(family)
    model.save_pretrained(tmp_path / family)
    norm, head, config = load_verifier_head(tmp_path / family, device="cpu", dtype=torch.float32)
    assert config.hidden_size == model.config.get_text_config().hidden_size
    torch.manual_seed(0)
    pre = torch.randn(17, config.hidden_size) * 4
    want = final_norm(model)(pre)
    got = norm(pre)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(head.weight, model.get_output_embeddings().weight)
    assert torch.equal(greedy_tokens(head, got, getattr(config, "final_logit_softcapping", None)),
                       greedy_tokens(model, want))


def test_bf16_head_on_request(tmp_path):
    model = family_model("qwen3")
    model.save_pretrained(tmp_path / "q")
    _norm, head, _ = load_verifier_head(tmp_path / "q", device="cpu", dtype=torch.bfloat16)
    assert head.weight.dtype == torch.bfloat16 and not head.weight.requires_grad


HIDDEN, VOCAB, LAYERS = 32, 300, 4


def _kimi_repo(path):
    """A Kimi-K2.5-shaped checkpoint: nested DeepSeek-V3 text_config, model_type kimi_k2, three shards, the vision
    tower's and an MTP layer's norms beside the language model's, the head in the last shard only."""
    from safetensors.torch import save_file

    torch.manual_seed(3)
    path.mkdir(parents=True)
    text = {"model_type": "kimi_k2", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "vocab_size": VOCAB,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_nextn_predict_layers": 1}
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"}, "text_config": text,
              "vision_config": {"hidden_size": 16}}
    (path / "config.json").write_text(json.dumps(config))
    lm = "language_model"
    shards = {
        "model-00001-of-00003.safetensors": {
            f"{lm}.model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN),
            "vision_tower.encoder.final_layernorm.weight": torch.randn(16),
            "vision_tower.encoder.final_layernorm.bias": torch.randn(16),
            f"{lm}.model.layers.0.input_layernorm.weight": torch.randn(HIDDEN)},
        "model-00002-of-00003.safetensors": {
            f"{lm}.model.layers.{i}.mlp.down_proj.weight": torch.randn(HIDDEN, HIDDEN) for i in range(LAYERS)},
        "model-00003-of-00003.safetensors": {
            f"{lm}.model.norm.weight": torch.rand(HIDDEN) + 0.5,
            f"{lm}.lm_head.weight": torch.randn(VOCAB, HIDDEN).bfloat16()},
    }
    shards["model-00002-of-00003.safetensors"][f"{lm}.model.layers.{LAYERS}.shared_head.norm.weight"] = \
        torch.randn(HIDDEN)  # the MTP layer's norm: not the final norm
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, path / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards["model-00003-of-00003.safetensors"]


def test_kimi_style_hub_repo_fetches_only_the_heads_shard(hub, tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    head_tensors = _kimi_repo(tmp_path / "repo")
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    with client_pointed_at(hub.url, cache_dir=cache):
        api = HfApi()
        api.create_repo("tester/kimi-tiny")
        api.upload_folder(repo_id="tester/kimi-tiny", folder_path=str(tmp_path / "repo"))
        norm, head, config = load_verifier_head("tester/kimi-tiny", device="cpu", dtype=torch.float32)
    fetched = sorted(p.name for p in cache.rglob("*") if p.is_file() and "snapshots" in p.parts)
    assert fetched == ["config.json", "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (LAYERS, HIDDEN, VOCAB)
    assert torch.equal(norm.weight, head_tensors["language_model.model.norm.weight"])
    assert torch.equal(head.weight, head_tensors["language_model.lm_head.weight"].float())
    x = torch.randn(5, HIDDEN)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.allclose(norm(x), ref)


@pytest.mark.parametrize("published", ["llama31_8b_text_config.json", "kimi_k25_text_config.json"])
def test_published_rope_scaling_configs_load(published, tmp_path):
    """Llama-3.1's and Kimi-K2.5's config.json as published (their `rope_scaling`), with a small head."""
    from pathlib import Path

    from safetensors.torch import save_file

    root = Path(__file__).resolve().parents[2]
    config = json.loads((root / "examples/recipes" / published).read_text())
    assert "rope_scaling" in config
    hidden, vocab = int(config["hidden_size"]), 64
    config["vocab_size"] = vocab
    (tmp_path / "config.json").write_text(json.dumps(config))
    weight = torch.rand(hidden) + 0.5
    save_file({"model.norm.weight": weight, "lm_head.weight": torch.randn(vocab, hidden)},
              tmp_path / "model.safetensors")
    norm, head, loaded = load_verifier_head(tmp_path, device="cpu", dtype=torch.float32)
    assert (loaded.hidden_size, loaded.num_hidden_layers) == (hidden, config["num_hidden_layers"])
    assert loaded.max_position_embeddings == config["max_position_embeddings"]
    assert torch.equal(norm.weight, weight) and head.weight.shape == (vocab, hidden)
