"""`evaluate --device-map`: a verifier too big for one device is placed by accelerate's dispatch (transformers'
`device_map`) instead of moved whole with `.to(device)`, and decodes exactly as the verifier placed whole does.
This machine has one device, so the map sends half the layers to disk (accelerate's hooks load them at every
forward, as they move a node's layers between GPUs); the GPU path shards it over a node's GPUs."""

from __future__ import annotations

import json

import pytest

from eagle3_hf.cli import main
from eagle3_hf.evaluation import evaluate as evaluate_module


def test_device_map_decodes_as_the_verifier_placed_whole(tmp_path, tiny_verifier_dir, monkeypatch):
    from eagle3_hf.verifier.loading import load_verifier

    from tests.helpers.drafters import random_drafter

    drafter = tmp_path / "drafter"
    random_drafter(load_verifier(str(tiny_verifier_dir)), draft_vocab_size=300).save_pretrained(drafter)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "Hi!"}\n{"id": "q2", "prompt": "Name a color."}\n')
    placed = []
    real = evaluate_module.place_verifier

    def spy(args, dtype):
        verifier, device = real(args, dtype)
        placed.append(getattr(verifier, "hf_device_map", None))
        return verifier, device

    monkeypatch.setattr(evaluate_module, "place_verifier", spy)
    decoded: list[list[int]] = []
    speculate = evaluate_module.speculative_decode

    def record(*args, **kwargs):
        out = speculate(*args, **kwargs)
        decoded.append(list(out.tokens))
        return out

    monkeypatch.setattr(evaluate_module, "speculative_decode", record)
    found = {}
    layers = {f"model.layers.{i}": "cpu" if i < 3 else "disk" for i in range(6)}  # the tiny verifier's 6
    device_map = {"model.embed_tokens": "cpu", **layers, "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    for name, flags in (("whole", ["--device", "cpu"]), ("mapped", ["--device-map", json.dumps(device_map)])):
        out = tmp_path / name
        assert main(["evaluate", "--drafter", str(drafter), "--verifier", str(tiny_verifier_dir), "--prompts",
                     str(prompts), "--k", "2", "--max-new-tokens", "8", "--output", str(out), "--no-progress",
                     *flags]) == 0
        found[name] = json.loads((out / "eagle3_evaluation.json").read_text())
    assert placed == [None, device_map]  # dispatched by accelerate the second time
    whole, mapped = found["whole"], found["mapped"]
    assert mapped["lossless"] is True and mapped["acceptance_length"] == whole["acceptance_length"]
    assert mapped["per_position_acceptance"] == whole["per_position_acceptance"]
    assert len(decoded) == 6 and decoded[:3] == decoded[3:]  # warm-up and both prompts: the same tokens


@pytest.mark.parametrize("flags, message", [
    (["--max-memory", "0=10GiB"], "error: --max-memory and --offload-folder need --device-map"),
    (["--device-map", "auto", "--device", "cpu"], "error: --device-map places the verifier itself: drop --device"),
])
def test_placement_options_that_do_not_fit_together(tmp_path, tiny_verifier_dir, capsys, flags, message):
    code = main(["evaluate", "--drafter", str(tmp_path), "--verifier", str(tiny_verifier_dir), "--output",
                 str(tmp_path / "o"), "--no-progress", *flags])
    assert code == 1 and capsys.readouterr().err.strip() == message
