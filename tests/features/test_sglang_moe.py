"""`extract --engine sglang` on mixture-of-experts verifiers (DeepSeek-V3, Kimi-K2.5's nesting, Qwen3-MoE), against
the SGLang stand-in that computes SGLang's answers with transformers (tests/helpers/sglang_stub.py).

The route runs the verifier's last layer here (verifier/last_layer.py). Checkpoints store one tensor per expert; the
transformers-5 class holds them fused: the layer is loaded through transformers' own conversion, and must give what
transformers' full forward gives. A layer too large for where it would run (Kimi-K2.5's) is refused before any
request."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf.features.interface import PreparedSample
from eagle3_hf.features.routes.sglang_server_client import SglangOptions
from eagle3_hf.features.table import SourceRequest, open_source
from eagle3_hf.publish.aux_id_rules import sglang_ids_to_send
from eagle3_hf.verifier import last_layer

from tests.helpers.families import MOE_FAMILIES, NUM_LAYERS, save_family_verifier
from tests.helpers.sglang_stub import SglangStub

AUX = (2, 3, 4)  # the 5-layer families' default; index N-1 = 4 among them


def stub_ids(family: str) -> list[int]:
    return sglang_ids_to_send(list(AUX), "llama" if family == "qwen3_moe" else "deepseek", NUM_LAYERS, "0.5.23")


def opened(url: str, verifier: str, **options):
    return open_source(SourceRequest("sglang-server", url, verifier, aux_indices=AUX, dtype="float32",
                                     options=SglangOptions(url, backoff_s=0.01, device="cpu", **options)))


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe(request, tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_family_verifier(request.param, path, tokenizer)


def test_the_checkpoint_stores_one_tensor_per_expert(moe):
    """What makes these verifiers a test of the conversion: the files hold experts.0.gate_proj.weight, the class
    mlp.experts.gate_up_proj (transformers 5)."""
    from safetensors import safe_open

    _family, path, model = moe
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = [k for k in f.keys() if f"s.{NUM_LAYERS - 1}.mlp.experts." in k]
    assert any(k.endswith("experts.0.gate_proj.weight") for k in stored), stored[:4]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in model.state_dict())


@torch.no_grad()
def test_an_moe_verifiers_features_are_transformers_full_forward(moe):
    """Aux states as captured, the last layer run here from SGLang's index N-1, normed: transformers' own
    output_hidden_states and greedy tokens, for a stored-per-expert MoE last layer."""
    family, path, model = moe
    with SglangStub(model=model, model_path=str(path), layer_ids=stub_ids(family)) as stub:
        source = opened(stub.url, str(path))
        source.check([20])
        walks = [list(range(1000, 1040, 2)), list(range(1301, 1201, -7))]
        samples = [PreparedSample(f"s{i}", torch.tensor(ids), torch.ones(len(ids), dtype=torch.long))
                   for i, ids in enumerate(walks)]
        got = list(source.states(samples))
    assert source.report()["next_token_agreement"] == 1.0
    for feats in got:
        out = model(feats.sample.input_ids[None], output_hidden_states=True)
        hs = [h[0] for h in out.hidden_states]
        torch.testing.assert_close(feats.aux_hidden_states, torch.cat([hs[i] for i in AUX], dim=-1))
        torch.testing.assert_close(feats.last_hidden_state, hs[-1])
        assert torch.equal(feats.verifier_greedy, out.logits[0].argmax(-1))


def test_extract_engine_sglang_writes_a_deepseek_v3s_features(tmp_path, tokenizer, fingerprint):
    """The command as a user runs it, on a tiny DeepSeek-V3 (it failed here, blaming a quantized checkpoint)."""
    from eagle3_hf.cli import main
    from eagle3_hf.features.reader import FeatureDataset

    from tests.helpers.serveable import walk_prepared

    verifier = tmp_path / "deepseek"
    model = save_family_verifier("deepseek_v3", verifier, tokenizer)
    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=3)
    with SglangStub(model=model, model_path=str(verifier), layer_ids=stub_ids("deepseek_v3")) as stub:
        assert main(["extract", "--engine", "sglang", "--endpoint", stub.url, "--verifier", str(verifier),
                     "--data", str(prepared), "--output", str(tmp_path / "out"), "--aux-layers", "2,3,4",
                     "--features-dtype", "fp32", "--device", "cpu", "--no-progress"]) == 0
    data = FeatureDataset(tmp_path / "out", "all")
    assert len(data) == 3
    for i in range(3):
        row = data[i]
        with torch.no_grad():
            out = model(row["input_ids"][None], output_hidden_states=True)
        torch.testing.assert_close(row["last_hidden_state"], out.hidden_states[-1][0])
        assert torch.equal(row["verifier_greedy"], out.logits[0].argmax(-1))


def test_a_quantized_last_layer_is_one_line(tmp_path, tokenizer):
    """Experts stored as packed integers (compressed-tensors' names, Kimi-K2.5's kind) convert into nothing the
    class holds: refused, naming what is missing."""
    from safetensors.torch import load_file, save_file

    verifier = tmp_path / "quantized"
    save_family_verifier("deepseek_v3", verifier, tokenizer)
    tensors = load_file(verifier / "model.safetensors")
    marker = f"layers.{NUM_LAYERS - 1}.mlp.experts."
    packed = {(k.replace(".weight", ".weight_packed") if marker in k else k): v for k, v in tensors.items()}
    save_file(packed, verifier / "model.safetensors", metadata={"format": "pt"})
    said = r"model\.layers\.4's mlp\.experts\.down_proj.*quantized checkpoint"
    with pytest.raises(ValueError, match=said) as refused:
        last_layer.LastLayer(str(verifier))
    one_line(refused)


def kimi_k25_config_dir(path):
    """Kimi-K2.5's config (its text_config: the sizes of examples/recipes/kimi_k25_text_config.json), no weights."""
    from pathlib import Path

    from transformers import Kimi_K25Config

    recipe = Path(__file__).resolve().parents[2] / "examples" / "recipes" / "kimi_k25_text_config.json"
    text = {k: v for k, v in json.loads(recipe.read_text()).items() if not k.startswith("_")}
    text["model_type"] = "deepseek_v3"  # what transformers' Kimi_K25Config makes of it
    Kimi_K25Config(text_config=text).save_pretrained(path)
    return path


def test_kimi_k25s_last_layer_is_refused_before_any_request(tmp_path, monkeypatch):
    """Kimi-K2.5's last layer is 384 experts: 17.1 B parameters, 68 GB in fp32, counted from its config alone (no
    weights here). On an H200 that SGLang holds at its default 0.88 of memory some 17 GB are free: refused in one
    line naming the route that serves Kimi, before any server is asked (none listens at this address)."""
    monkeypatch.setattr(last_layer, "free_bytes", lambda device: int(0.12 * 141e9))
    verifier = kimi_k25_config_dir(tmp_path / "kimi")
    with pytest.raises(ValueError) as refused:
        opened("http://127.0.0.1:9", str(verifier), retries=0)
    said = one_line(refused)
    assert "layer 60" in said and "384 experts" in said and "17.1 B parameters, 68.2 GB in fp32" in said, said
    assert "16.9 GB free on cpu" in said and "`extract --engine vllm`" in said, said


def test_the_budget_is_where_the_layer_runs(moe, monkeypatch):
    """The same check on a tiny MoE verifier: it fits in what this machine has free; not in 1 kB."""
    family, path, _model = moe
    plan = last_layer.plan_last_layer(str(path))
    assert plan.index == NUM_LAYERS - 1 and plan.experts == 4 and plan.fp32_bytes == 4 * plan.parameters
    last_layer.check_fits(plan, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"more than the 0.0 GB free on cpu"):
        last_layer.check_fits(plan, torch.device("cpu"), free=1000)


def test_a_dense_last_layer_counts_no_experts(tiny_verifier_dir):
    plan = last_layer.plan_last_layer(str(tiny_verifier_dir))
    assert plan.experts == 0 and plan.index == 5 and plan.parameters > 0
    with pytest.raises(ValueError) as refused:
        last_layer.check_fits(plan, torch.device("cpu"), free=1000)
    assert "experts" not in one_line(refused)
