"""Verifiers beyond Llama, end to end through the real CLI: DeepSeek-V3 (MLA + MoE + YaRN), the same nested
as Kimi-K2.5 nests it, Qwen3, and Gemma 3 (sliding-window and full layers with their own RoPE, scaled
embeddings). Each runs prepare -> extract -> vocab -> train -> evaluate (greedy and sampling) -> export ->
check; plus the drafter RoPE for a per-layer-type verifier and extraction split over two devices."""

from __future__ import annotations

import json
import logging
import warnings
from contextlib import contextmanager

import pytest
import torch

from eagle3_hf import cli
from eagle3_hf.model.configuration_eagle3 import Eagle3Config
from eagle3_hf.publish.check import check_drafter

from tests.helpers.families import FAMILIES, family_model, save_family_verifier


@contextmanager
def transformers_warnings():
    """Everything transformers logs at WARNING or above, and Python warnings, while the block runs."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("transformers")
    handler = Collect(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
        records.extend(str(w.message) for w in caught)
    finally:
        logger.removeHandler(handler)


def _fresh_margins(verifier, ids: list[int]) -> list[float]:
    """Top-1 minus top-2 logit at every position of one uncached forward."""
    with torch.no_grad():
        logits = verifier(input_ids=torch.tensor([ids])).logits[0].float()
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_end_to_end(family, tmp_path, tokenizer):
    from eagle3_hf.decoding import speculative_decode
    from eagle3_hf.evaluation.evaluate import render_prompt
    from eagle3_hf.model.modeling_eagle3 import Eagle3DraftModel
    from eagle3_hf.verifier.loading import load_verifier

    verifier_dir = tmp_path / "verifier"
    save_family_verifier(family, verifier_dir, tokenizer)
    v, out = str(verifier_dir), tmp_path
    assert cli.main(["prepare", "--tokenizer", v, "--input", "default", "--limit", "40", "--output",
                     str(out / "prepared"), "--max-seq-len", "96"]) == 0
    assert cli.main(["extract", "--verifier", v, "--data", str(out / "prepared"), "--output", str(out / "features"),
                     "--features-dtype", "fp32", "--no-progress"]) == 0
    assert cli.main(["vocab", "--data", str(out / "prepared"), "--draft-vocab-size", "512", "--output",
                     str(out / "features" / "vocab.safetensors")]) == 0
    assert cli.main(["train", "--verifier", v, "--features", str(out / "features"),
                     "--output-dir", str(out / "drafter"),
                     "--num-train-epochs", "4", "--learning-rate", "5e-3", "--max-seq-len", "96",
                     "--per-device-train-batch-size", "2", "--validation-fraction", "0.25", "--eval-strategy", "no",
                     "--save-strategy", "no", "--logging-steps", "4", "--seed", "0", "--disable-tqdm", "true"]) == 0
    trained = json.loads((out / "drafter" / "eagle3_training.json").read_text())
    losses = [r["loss"] for r in trained["log_history"] if "loss" in r]
    assert losses and all(loss == loss for loss in losses)  # no NaN trained into the checkpoint

    evaluate = ["evaluate", "--drafter", str(out / "drafter"), "--verifier", v, "--prompts", "mt-bench",
                "--num-prompts", "2", "--max-new-tokens", "16", "--k", "3", "--no-progress"]
    assert cli.main(evaluate + ["--temperature", "0", "--output", str(out / "eval_greedy")]) == 0
    greedy = json.loads((out / "eval_greedy" / "eagle3_evaluation.json").read_text())
    assert greedy["lossless"] is True and greedy["mismatches"] == 0 and greedy["new_tokens"] > 0
    assert cli.main(evaluate + ["--temperature", "0.8", "--output", str(out / "eval_sampled")]) == 0
    sampled = json.loads((out / "eval_sampled" / "eagle3_evaluation.json").read_text())
    assert sampled["new_tokens"] > 0 and 1.0 <= sampled["acceptance_length"] <= 4.0

    # sampling is exact iff every verify step scores the right distribution: the cached, cropped-on-rejection
    # verifier must give the same logits as one uncached forward over what was emitted
    verifier = load_verifier(v)
    drafter = Eagle3DraftModel.from_pretrained(out / "drafter", verifier=verifier)
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Name three colours of the rainbow."}])
    run = speculative_decode(verifier, drafter, prompt, steps=3, max_new_tokens=24, temperature=0.8,
                             generator=torch.Generator().manual_seed(0), eos_token_id=[])
    assert sum(d - a for a, d in zip(run.accepted_per_step, run.drafted_per_step)) > 0  # rejections happened
    fresh = _fresh_margins(verifier, prompt + run.tokens[:-1])[len(prompt) - 1:]
    assert run.margins == pytest.approx(fresh, abs=1e-3)

    assert cli.main(["export", str(out / "drafter"), "--output", str(out / "export"), "--format", "standard"]) == 0
    from transformers import AutoConfig

    with transformers_warnings() as logged:
        AutoConfig.from_pretrained(out / "export")  # what an engine parses
        Eagle3Config.from_pretrained(out / "export")
    assert logged == []
    # against the releases the project pins: without a release, a YaRN export (DeepSeek-V3, Kimi) carries warnings
    # naming the older releases that do not read its mscale keys (eagle3_hf/publish/rope_rules.py)
    pinned = {"vllm": "0.32.0", "sglang": "0.5.23"}
    found = check_drafter(str(out / "export"), verifier=v, engine_versions=pinned)
    assert [str(f) for f in found if f.level != "info"] == []
    assert cli.main(["check", str(out / "export"), "--verifier", v, "--engine", "all"]) == 0


def test_per_layer_type_rope_is_written_flat_and_is_the_one_training_used():
    """Gemma 3: the drafter gets the full-attention RoPE (linear x2, theta 1e6), flat, as rope_parameters and
    as the legacy keys; the rotary embedding the drafter trains with equals the verifier's full-attention one."""
    from transformers import LlamaConfig

    from eagle3_hf.model.modeling_eagle3 import Eagle3DraftModel

    verifier = family_model("gemma3")
    full = verifier.config.rope_parameters["full_attention"]
    with transformers_warnings() as logged:
        config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=64)
    assert logged == []
    with transformers_warnings() as mixed_logged:  # what copying the nested form used to give a Llama config
        LlamaConfig(rope_parameters={**verifier.config.rope_parameters, "rope_type": "default", "rope_theta": 1e4})
    assert any("Unrecognized keys" in m for m in mixed_logged)
    assert config.rope_parameters == full
    saved = config.to_dict()
    assert saved["rope_theta"] == full["rope_theta"]
    assert saved["rope_scaling"] == {"rope_type": "linear", "type": "linear", "factor": 2.0}
    drafter = Eagle3DraftModel(config)
    assert config.head_dim == verifier.config.head_dim
    x, positions = torch.zeros(1, 40, 8), torch.arange(40)[None]
    trained_cos, trained_sin = drafter.rotary_emb(x, positions)
    verifier_cos, verifier_sin = verifier.model.rotary_emb(x, positions, "full_attention")
    torch.testing.assert_close(trained_cos, verifier_cos)
    torch.testing.assert_close(trained_sin, verifier_sin)
    local_cos, _ = verifier.model.rotary_emb(x, positions, "sliding_attention")
    assert not torch.allclose(trained_cos, local_cos)  # the choice is visible: the local RoPE differs


def test_check_fails_the_mixed_per_layer_type_rope(tmp_path):
    from tests.helpers.drafters import standard_config, standard_tensors, write_checkpoint

    mixed = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
             "rope_type": "default", "rope_theta": 10000.0}
    cfg = standard_config(rope_parameters=mixed)
    path = write_checkpoint(tmp_path / "mixed", cfg, standard_tensors(cfg))
    codes = {f.code for f in check_drafter(str(path)) if f.level == "error"}
    assert "rope-per-layer-type" in codes
    flat = standard_config()
    assert not [f for f in check_drafter(str(write_checkpoint(tmp_path / "flat", flat, standard_tensors(flat))))
                if f.code.startswith("rope")]


def test_device_map_extraction_over_two_devices_equals_one_device(tmp_path, tokenizer):
    """`--device-map auto --max-memory cpu=B`: the budget holds the embedding and the first layers; accelerate
    puts the other layers, the final norm and lm_head on its second device, "disk" (weights in an offload
    folder, streamed in by its hooks at each forward). The aux hooks then fire on layers of both devices."""
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle3_hf.verifier.loading import load_verifier

    verifier_dir = tmp_path / "verifier"
    save_family_verifier("deepseek_v3", verifier_dir, tokenizer)
    v = str(verifier_dir)
    assert cli.main(["prepare", "--tokenizer", v, "--input", "default", "--limit", "4", "--output",
                     str(tmp_path / "prepared"), "--max-seq-len", "64"]) == 0
    with init_empty_weights():
        sizes = compute_module_sizes(AutoModelForCausalLM.from_config(family_model("deepseek_v3").config))
    # accelerate keeps room for the largest module (the embedding) to stream offloaded ones in
    budget = 2 * sizes["model.embed_tokens"] + sizes["model.layers.0"] + sizes["model.layers.1"] + 1024
    split = load_verifier(v, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(tmp_path / "probe"))
    placed = split.hf_device_map
    assert placed["model.layers.0"] == "cpu" and placed["model.layers.3"] == "disk" and placed["lm_head"] == "disk"

    common = ["extract", "--verifier", v, "--data", str(tmp_path / "prepared"), "--features-dtype", "fp32",
              "--no-progress"]
    assert cli.main(common + ["--output", str(tmp_path / "one")]) == 0
    # a budget below the weights is refused unless the spill to disk is asked for (--offload-folder)
    assert cli.main(common + ["--output", str(tmp_path / "two"), "--device-map", "auto", "--max-memory",
                              f"cpu={budget}"]) != 0
    assert cli.main(common + ["--output", str(tmp_path / "two"), "--device-map", "auto", "--max-memory",
                              f"cpu={budget}", "--offload-folder", str(tmp_path / "spill")]) == 0
    one_manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    two_manifest = json.loads((tmp_path / "two" / "manifest.json").read_text())
    assert [s["id"] for s in one_manifest["samples"]] == [s["id"] for s in two_manifest["samples"]]
    shards = sorted(p.name for p in (tmp_path / "one").glob("**/*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "two").glob("**/*.safetensors"))
    for name in shards:
        a = load_file(str(next((tmp_path / "one").glob(f"**/{name}"))))
        b = load_file(str(next((tmp_path / "two").glob(f"**/{name}"))))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=f"{name}:{key}")


@pytest.mark.parametrize("family", FAMILIES)
def test_aux_features_are_the_residual_stream_every_family(family):
    """The hooked layer outputs are the `output_hidden_states` entries (the stream entering the next layer,
    what the engines capture), and the final state is post-norm, for MoE/MLA, nested and sliding layers."""
    from eagle3_hf.verifier.capture import capture_features

    verifier = family_model(family)
    ids = torch.randint(3, 5000, (24,), generator=torch.Generator().manual_seed(0))
    feats = capture_features(verifier, ids, [1, 2, 4])
    with torch.no_grad():
        out = verifier(input_ids=ids[None], output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i][0] for i in (1, 2, 4)], dim=-1)
    torch.testing.assert_close(feats["aux_hidden_states"], expected, rtol=0, atol=0)
    assert torch.equal(feats["verifier_greedy"], out.logits[0].argmax(-1))


def test_drafter_embeds_with_the_raw_verifier_embedding_not_gemmas_scaled_one():
    from eagle3_hf.model.modeling_eagle3 import Eagle3DraftModel

    verifier = family_model("gemma3")
    drafter = Eagle3DraftModel(Eagle3Config.from_verifier(verifier.config, draft_vocab_size=64))
    drafter.load_verifier_embeddings(verifier)
    ids = torch.tensor([[5, 17, 300]])
    raw = verifier.model.embed_tokens.weight[ids]
    torch.testing.assert_close(drafter.embed_tokens(ids), raw)
    scaled = verifier.get_input_embeddings()(ids)  # what the verifier's own first layer reads
    torch.testing.assert_close(scaled, raw * verifier.config.hidden_size ** 0.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_is_lossless_with_rejections_every_family(family):
    """A random drafter is rejected at almost every step, so the verifier's cache is cropped all the time:
    for Gemma 3 that crosses its 8-token sliding window, which must be rolled back, not lost."""
    from eagle3_hf.data.vocab import vocab_from_target_ids
    from eagle3_hf.decoding import greedy_generate, speculative_decode
    from eagle3_hf.model.modeling_eagle3 import Eagle3DraftModel

    verifier = family_model(family)
    torch.manual_seed(0)
    drafter = Eagle3DraftModel(Eagle3Config.from_verifier(verifier.config, draft_vocab_size=256)).eval()
    drafter.set_vocab_mapping(*vocab_from_target_ids(torch.arange(256), verifier.config.get_text_config().vocab_size))
    drafter.load_verifier_embeddings(verifier)
    prompt = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    base = greedy_generate(verifier, prompt, 20, eos_token_id=[])
    spec = speculative_decode(verifier, drafter, prompt, steps=3, max_new_tokens=20, eos_token_id=[])
    assert len(spec.accepted_per_step) > 3  # several verify steps, each cropping rejected drafts
    assert spec.tokens == base.tokens
