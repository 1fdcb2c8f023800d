"""`eagle3-hf check --engine llamacpp`: the rules of llama.cpp's GGUF converter and EAGLE-3 loader
(eagle3_hf/publish/llamacpp_rules.py), each refusal one line, before any conversion; no build needed."""

from __future__ import annotations

import torch

from eagle3_hf.cli import main
from eagle3_hf.publish.check import check_drafter

from tests.helpers.drafters import AUX, HIDDEN, VERIFIER_LAYERS, write_drafter, write_verifier_config
from tests.helpers.findings import codes, message


def llamacpp(path, verifier=None):
    return check_drafter(path, verifier=str(verifier) if verifier else None, engine="llamacpp")


def errors(findings):
    return codes(findings, "error")


def test_a_good_export_passes(tmp_path):
    good = write_drafter(tmp_path / "good")
    assert llamacpp(good) == []
    assert llamacpp(good, write_verifier_config(tmp_path / "verifier")) == []


def test_an_eagle31_export_is_refused_in_one_line_each(tmp_path, capsys):
    fc_norm = {f"fc_norm.{i}.weight": torch.ones(HIDDEN) for i in range(3)}
    path = write_drafter(tmp_path / "d31", fc_norm=True, norm_output=True, replace=fc_norm)
    found = llamacpp(path)
    assert errors(found) == {"llamacpp-fc-norm", "llamacpp-norm-output"}
    assert "cannot map fc_norm.*" in message(found, "llamacpp-fc-norm")
    assert "pre-norm state" in message(found, "llamacpp-norm-output")
    # SGLang and vLLM serve the same export: these are llama.cpp's alone
    assert not {"llamacpp-fc-norm", "llamacpp-norm-output"} & codes(check_drafter(path, engine="vllm"))
    assert main(["check", str(path), "--engine", "llamacpp"]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ERROR")]
    assert len(lines) == 2 and all("llama.cpp" in ln for ln in lines)


def test_a_four_aux_layer_export_is_refused_in_one_line(tmp_path):
    path = write_drafter(tmp_path / "d4", eagle_aux_hidden_state_layer_ids=[1, 2, 4, 5])
    found = llamacpp(path)
    assert [f.code for f in found if f.code.startswith(("aux-ids", "llamacpp"))] == ["llamacpp-aux-count"]
    assert "refuses any count but 3" in message(found, "llamacpp-aux-count")
    assert "src/models/eagle3.cpp" in message(found, "llamacpp-aux-count")


def test_ids_only_in_eagle_config_fall_back_to_the_default(tmp_path):
    verifier = write_verifier_config(tmp_path / "verifier")
    default = [2, VERIFIER_LAYERS // 2, VERIFIER_LAYERS - 3]  # [2, 4, 5]: what llama.cpp captures without ids
    assert default == AUX
    trained_on_default = write_drafter(tmp_path / "a", eagle_aux_hidden_state_layer_ids=...)
    assert llamacpp(trained_on_default, verifier) == []  # SGLang's reading of eagle_config is the default too
    other = write_drafter(tmp_path / "b", eagle_aux_hidden_state_layer_ids=...,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 6], "use_aux_hidden_state": True})
    found = llamacpp(other, verifier)
    assert "llamacpp-aux-ids" in errors(found)
    said = message(found, "llamacpp-aux-ids")
    assert "captures its default [2, 4, 5], but the drafter was trained on [1, 3, 7]" in said
    unknown_depth = write_drafter(tmp_path / "c", eagle_aux_hidden_state_layer_ids=..., verifier_num_hidden_layers=...)
    assert "llamacpp-aux-ids" in codes(llamacpp(unknown_depth), "warning")  # no depth, no verifier: a warning


def test_the_last_layer_is_refused_and_the_one_before_it_is_not(tmp_path):
    """Id N (the verifier's last state) is llama.cpp's nextn capture, never produced by a Llama target; id N - 1 is
    an ordinary layer input. Both asked, so a rule off by one either way fails here."""
    verifier = write_verifier_config(tmp_path / "verifier")
    last = [2, 4, VERIFIER_LAYERS]
    found = llamacpp(write_drafter(tmp_path / "n", eagle_aux_hidden_state_layer_ids=last,
                                   aux_hidden_state_indices=last), verifier)
    assert "llamacpp-aux-last" in errors(found)
    assert f"aux id {VERIFIER_LAYERS} (the verifier's last state)" in message(found, "llamacpp-aux-last")
    before = [2, 4, VERIFIER_LAYERS - 1]
    found = llamacpp(write_drafter(tmp_path / "n-1", eagle_aux_hidden_state_layer_ids=before,
                                   aux_hidden_state_indices=before), verifier)
    assert "llamacpp-aux-last" not in codes(found) and "llamacpp-aux-ids" not in codes(found)


def test_the_ids_written_are_compared_with_the_ones_trained_on(tmp_path):
    """Top-level ids equal to the recorded training indices pass; one id one layer off is an error naming both
    (a comparison that shifts either side by one fails one of the two)."""
    verifier = write_verifier_config(tmp_path / "verifier")
    same = llamacpp(write_drafter(tmp_path / "same", aux_hidden_state_indices=list(AUX)), verifier)
    assert "llamacpp-aux-ids" not in codes(same)
    shifted = [*AUX[:2], AUX[2] + 1]  # [2, 4, 6]: trained one layer later than written
    found = llamacpp(write_drafter(tmp_path / "a", aux_hidden_state_indices=shifted), verifier)
    assert "llamacpp-aux-ids" in errors(found)
    assert f"eagle_aux_hidden_state_layer_ids {AUX}" in message(found, "llamacpp-aux-ids")
    assert f"aux_hidden_state_indices {shifted}" in message(found, "llamacpp-aux-ids")


def test_norm_before_fc_is_read_from_the_top_level_only(tmp_path):
    path = write_drafter(tmp_path / "d", replace={"input_norm.weight": torch.ones(3 * HIDDEN)}, norm_before_fc=True,
                         eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True,
                                       "norm_before_fc": False})
    assert "llamacpp-norm-before-fc" in errors(llamacpp(path))
    both = write_drafter(tmp_path / "ok", replace={"input_norm.weight": torch.ones(3 * HIDDEN)}, norm_before_fc=True)
    assert not errors(llamacpp(both))


def test_window_detection_and_unmappable_names(tmp_path):
    window = write_drafter(tmp_path / "w", sliding_window=128, layer_types=["sliding_attention"])
    assert "llamacpp-window" in errors(llamacpp(window))
    plain = write_drafter(tmp_path / "p", num_hidden_layers=2)
    assert "llamacpp-not-eagle3" in errors(llamacpp(plain))
    prefixed = write_drafter(tmp_path / "m", rename={"fc.weight": "model.fc.weight"})
    assert "unknown-weights" in errors(llamacpp(prefixed))


def test_llamacpp_is_checked_by_name_not_as_part_of_all(tmp_path):
    """`all` is what loads the standard layout by repo id (SGLang, vLLM, and push): an EAGLE 3.1 drafter serves
    there; llama.cpp's rules refuse it only when llama.cpp is asked for."""
    fc_norm = {f"fc_norm.{i}.weight": torch.ones(HIDDEN) for i in range(3)}
    path = write_drafter(tmp_path / "d31", fc_norm=True, replace=fc_norm)
    assert "llamacpp-fc-norm" in errors(check_drafter(path, engine="llamacpp"))
    assert "llamacpp-fc-norm" not in codes(check_drafter(path))
    assert "llamacpp-fc-norm" not in codes(check_drafter(path, engine=("sglang", "vllm")))
