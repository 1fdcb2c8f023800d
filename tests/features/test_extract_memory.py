"""`extract` refuses a verifier its memory cannot hold before a weight is read: the weights' bytes from the config
and safetensors (verifier/footprint.py) against --max-memory, the device map's devices or the one device."""

from __future__ import annotations

import json

import pytest

from eagle3_hf.cli import main
from eagle3_hf.verifier.footprint import checkpoint_footprint, footprint, stored_bytes

from tests.helpers.data import make_prepared

LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False}


@pytest.fixture
def claims_8b(tmp_path, tiny_verifier_dir):
    """The tiny verifier's files with a config.json that claims Llama-3.1-8B's sizes (its weights stay tiny)."""
    import shutil

    path = tmp_path / "claims_8b"
    shutil.copytree(tiny_verifier_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.update(LLAMA_8B)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture
def no_loading(monkeypatch):
    """Any weight load fails the test: the refusal must come first."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr("eagle3_hf.verifier.loading.load_verifier", refuse)


def extract(verifier, prepared, out, *extra):
    return main(["extract", "--verifier", str(verifier), "--data", str(prepared), "--output", str(out),
                 "--no-progress", *extra])


def test_a_verifier_whose_config_claims_more_than_the_budget_is_refused_before_loading(
        tmp_path, claims_8b, tiny_verifier_dir, fingerprint, capsys, no_loading):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=3)
    capsys.readouterr()
    rc = extract(claims_8b, prepared, tmp_path / "out", "--device-map", "auto", "--max-memory", "cpu=2GiB",
                 "--torch-dtype", "bfloat16")
    err = capsys.readouterr().err.strip()
    assert rc != 0 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: --verifier {claims_8b}: its weights take 16.1 GB (bfloat16, from config sizes), "
                          "more than the 2.0 GiB of --max-memory cpu=2GiB")
    assert "--engine vllm" in err and not (tmp_path / "out").exists()
    # in float32 (the tiny checkpoint's own dtype under auto) twice that
    assert extract(claims_8b, prepared, tmp_path / "out", "--device-map", "auto", "--max-memory", "cpu=20GiB") != 0
    assert "its weights take 32.1 GB (float32" in capsys.readouterr().err
    # an explicit offload folder is the user's choice to spill: a warning, then the load (refused here by the fixture)
    with pytest.raises(AssertionError, match="a weight was loaded"):
        extract(claims_8b, prepared, tmp_path / "out", "--device-map", "auto", "--max-memory", "cpu=2GiB",
                "--offload-folder", str(tmp_path / "spill"))
    assert "WARNING: --verifier" in capsys.readouterr().err


def test_one_device_without_room_is_refused_and_a_verifier_that_fits_extracts(
        tmp_path, tiny_verifier_dir, fingerprint, capsys, monkeypatch):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=3)
    weights = checkpoint_footprint(str(tiny_verifier_dir))
    assert weights.bytes == stored_bytes(tiny_verifier_dir) and weights.dtype == "float32"
    monkeypatch.setattr("eagle3_hf.verifier.memory.ram_bytes", lambda: int(weights.bytes) - 1)
    assert extract(tiny_verifier_dir, prepared, tmp_path / "out", "--device", "cpu") != 0
    assert "more than the 0.0 GiB of this machine's RAM" in capsys.readouterr().err
    monkeypatch.setattr("eagle3_hf.verifier.memory.ram_bytes", lambda: int(weights.bytes))
    assert extract(tiny_verifier_dir, prepared, tmp_path / "out", "--device", "cpu") == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["total_samples"] == 3
    # with a device map, a budget that holds it
    assert extract(tiny_verifier_dir, prepared, tmp_path / "mapped", "--device-map", "auto", "--max-memory",
                   "cpu=1GiB") == 0


def test_bf16_kimi_is_2_tb_and_its_int4_checkpoint_a_third_of_that():
    """The guide's old route (c): transformers would need Kimi-K2.5 whole; in bf16 that is ~2 TB against
    8 x 141 GB, stored (INT4 routed experts) ~594 GB."""
    from pathlib import Path

    config = json.loads((Path(__file__).resolve().parents[2] / "examples/recipes/kimi_k25_text_config.json")
                        .read_text())
    stored = footprint(config)
    assert stored.quantized == "compressed-tensors" and stored.bytes / 1e9 == pytest.approx(594, rel=0.01)
    plain = dict(config)
    plain.pop("quantization_config")
    bf16 = footprint(plain, "bfloat16").bytes
    assert bf16 / 1e9 == pytest.approx(2053, rel=0.01) and bf16 > 8 * 141 * 2**30


def test_a_checkpoint_quantized_by_a_method_whose_package_is_missing_is_refused_before_loading(
        tmp_path, tiny_verifier_dir, fingerprint, capsys, no_loading):
    """Kimi-K2.5's INT4 experts (compressed-tensors) on the transformers route: its package is not installed, so
    the load could only fail later (or dequantize); refused first, naming the package and the vLLM route."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("compressed_tensors"):
        pytest.skip("compressed-tensors is installed here")
    path = tmp_path / "int4"
    shutil.copytree(tiny_verifier_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "group_size": 32}}}, "ignore": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=3)
    capsys.readouterr()
    assert extract(path, prepared, tmp_path / "out", "--device", "cpu") != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "stored quantized" in err and "`compressed-tensors` package" in err, err
    assert "--engine vllm" in err


def test_evaluate_refuses_the_same_verifier_before_loading(tmp_path, claims_8b, capsys, no_loading):
    """`evaluate` loads the verifier in this process too: the same check, before the drafter or the verifier."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "Hi!"}\n')
    rc = main(["evaluate", "--drafter", str(tmp_path / "no-drafter"), "--verifier", str(claims_8b), "--prompts",
               str(prompts), "--output", str(tmp_path / "eval"), "--device-map", "auto", "--max-memory", "cpu=2GiB",
               "--torch-dtype", "bfloat16", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.splitlines()[-1].startswith(f"error: --verifier {claims_8b}: its weights take 16.1 GB")
    assert "--engine vllm" in err.splitlines()[-1]
