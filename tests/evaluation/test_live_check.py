"""`eagle3-hf check DRAFTER --endpoint URL`: the served per-position acceptance against the validation accuracies
the drafter recorded at training. Fast here: the comparison on recorded counters, and the command against a stand-in
server (tests/helpers/engine_stub.py) that reports as vLLM or SGLang do. Against a real vLLM CPU server:
tests/evaluation/test_live_check_vllm.py (slow)."""

from __future__ import annotations

import json

import pytest

from eagle3_hf.cli import main
from eagle3_hf.evaluation.check_command import NO_VERDICT
from eagle3_hf.evaluation.live_check import parse_vllm_counters, sglang_counts, vllm_difference
from eagle3_hf.publish.served_acceptance import (
    MIN_VERIFY_STEPS,
    ServedCounts,
    compare,
    implied_tau,
    recorded_accuracies,
    steps_to_detect,
    wilson_upper,
)

from tests.helpers.drafters import write_drafter
from tests.helpers.engine_stub import EngineStub, vllm_metrics

RECORDED = [0.8, 0.7, 0.6]
# ten verify steps per answer, accepted drafts each: conditional 8/10, 6/8, 4/6 (about what training recorded)
SERVED_WELL = [3, 3, 3, 3, 2, 2, 1, 1, 0, 0]
SERVED_BROKEN = [0, 0, 0, 0, 0, 0, 0, 0, 0, 1]  # what a drafter fed other layers' states accepts


@pytest.fixture
def drafter(tmp_path):
    path = write_drafter(tmp_path / "drafter")
    (path / "eagle3_training.json").write_text(json.dumps({"metrics": {
        "step_accuracy": [0.8, 0.56, 0.34], "step_conditional_accuracy": RECORDED,
        "simulated_acceptance_length": implied_tau(RECORDED)}}))
    return path


def test_vllm_counters_are_read_from_its_metrics_text_and_differenced():
    before = parse_vllm_counters(vllm_metrics(11, [7, 4, 2], k=3, engines=2))
    assert before["num_drafts"] == 11 and before["per_pos"] == [7, 4, 2] and before["num_draft_tokens"] == 33
    after = parse_vllm_counters(vllm_metrics(91, [71, 52, 34], k=3, engines=2))
    served = vllm_difference(before, after, prompts=8, engine="vLLM")
    assert served == ServedCounts("vLLM", 80, (64, 48, 32), 8)
    assert served.conditional(0) == 0.8 and served.conditional(1) == 0.75 and served.tau() == pytest.approx(2.8)
    empty = parse_vllm_counters("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")
    with pytest.raises(Exception, match="serves no drafter"):
        vllm_difference(empty, empty, 1, "vLLM at http://x")


def test_sglang_histograms_become_per_position_counts():
    details = [{"spec_verify_ct": 4, "spec_num_proposed_drafts": 12, "spec_correct_drafts_histogram": [1, 1, 0, 2]},
               {"spec_verify_ct": 2, "spec_num_proposed_drafts": 6, "spec_accept_histogram": [0, 2]}]  # older name
    served = sglang_counts(details, k=None, prompts=2, engine="SGLang")
    assert served.drafts == 6 and served.accepted_per_pos == (5, 2, 2)  # steps that accepted more than j drafts


def test_the_wilson_bound_is_the_textbook_one():
    # no success in 100 tries, one-sided 99%: z^2 / (n + z^2) with z = 2.3263
    assert wilson_upper(0, 100, 0.99) == pytest.approx(2.3263**2 / (100 + 2.3263**2), rel=1e-4)
    assert wilson_upper(50, 100, 0.99) == pytest.approx(0.6132, abs=1e-3)
    assert wilson_upper(0, 0, 0.99) == 1.0


def test_a_served_gap_beyond_the_margin_fails_and_names_the_likely_causes():
    good = compare(ServedCounts("vLLM at u", 80, (64, 48, 32), 8), RECORDED)
    assert good.ok and good.recorded_tau == pytest.approx(1 + 0.8 + 0.56 + 0.336)
    assert "within 0.15 of it at every position" in good.line("vLLM at u")
    broken = compare(ServedCounts("vLLM at u", 80, (8, 0, 0), 8), RECORDED)
    assert broken.verdict == "fail" and [p.below for p in broken.positions] == [True, False, False]  # 8, 0 tries
    line = broken.line("vLLM at u")
    assert "position 1 serves 0.10" in line and "aux-layer ids" in line and "RoPE" in line and "d2t" in line
    assert "\n" not in line
    # few tries are no verdict either way: 4 of 10 against 0.8 - 0.15 has an upper bound above 0.65
    assert compare(ServedCounts("e", 10, (4, 3, 2), 1), RECORDED).positions[0].upper > 0.65
    assert compare(ServedCounts("e", 10, (4, 3, 2), 1), RECORDED).verdict == "undecided"
    # serving better than validation is never a failure; positions past those recorded are not compared
    better = compare(ServedCounts("e", 80, (80, 80, 80, 80, 80), 8), RECORDED)
    assert better.verdict == "pass"
    assert better.ok and len(better.positions) == 3 and "positions 4-5 not compared" in better.line("e")


def test_the_margin_shrinks_with_evidence():
    """The same served rates, 0.55 / 0.70 / 0.60 of the steps reaching each position, against recorded 0.8 / 0.7 /
    0.6: too few steps for a verdict, then a pass (the bound still covers the floor 0.65), then a failure."""
    def served(n: int) -> ServedCounts:
        return ServedCounts("e", n, (round(0.55 * n), round(0.385 * n), round(0.231 * n)), 1)

    verdicts = {n: compare(served(n), RECORDED) for n in (19, 40, 100, 200)}
    assert [verdicts[n].verdict for n in (19, 40, 100, 200)] == ["undecided", "undecided", "pass", "fail"]
    assert [p.needed for p in verdicts[100].positions] == [MIN_VERIFY_STEPS] * 3
    assert "position 1 was reached by 19 verify step(s) of 1 prompt(s), 20 needed" in verdicts[19].line("e")
    assert "position 3 was reached by 15 verify step(s)" in verdicts[40].line("e")  # 0.385 * 40: short at 3
    assert "position 1 serves 0.55" in verdicts[200].line("e")
    # the evidence a position needs: at least --min-verify-steps, and enough that a served 0 could fail
    assert compare(served(100), RECORDED, min_steps=101).verdict == "undecided"
    assert steps_to_detect(0.65, 0.99) == 3 and steps_to_detect(0.05, 0.99) == 103  # z^2 (1 - f) / f, rounded up
    low = compare(ServedCounts("e", 100, (30, 2, 1), 1), [0.4, 0.1, 0.1])  # floors 0.25, -0.05, -0.05
    assert [p.needed for p in low.positions] == [23, None, None] and low.verdict == "pass"  # 0 of 22 could pass
    assert compare(ServedCounts("e", 0, (0, 0, 0), 0), RECORDED).verdict == "undecided"  # nothing served


def test_the_tolerance_moves_the_margin():
    served = ServedCounts("e", 400, (240, 160, 90), 8)  # 0.60 / 0.67 / 0.56 against 0.8 / 0.7 / 0.6
    assert compare(served, RECORDED, tolerance=0.15).ok
    assert not compare(served, RECORDED, tolerance=0.05).ok
    with pytest.raises(ValueError, match="--tolerance"):
        compare(served, RECORDED, tolerance=1.5)


def test_a_drafter_without_recorded_validation_is_one_line(tmp_path):
    path = write_drafter(tmp_path / "d")
    with pytest.raises(FileNotFoundError, match="has no eagle3_training.json"):
        recorded_accuracies(path)
    (path / "eagle3_training.json").write_text(json.dumps({"metrics": {"step_conditional_accuracy": [None, None]}}))
    with pytest.raises(ValueError, match="recorded no validation metrics"):
        recorded_accuracies(path)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_check_endpoint_passes_what_is_served_as_trained_and_fails_a_gap(engine, drafter, capsys):
    with EngineStub(engine, [SERVED_WELL]) as stub:
        code = main(["check", str(drafter), "--endpoint", stub.url, "--num-prompts", "8", "--max-new-tokens", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    (line,) = [ln for ln in out.splitlines() if "served-acceptance" in ln]
    name = "vLLM" if engine == "vllm" else "SGLang"
    assert line.startswith("INFO") and f"{name} at {stub.url} accepts 0.80 / 0.75 / 0.67" in line
    assert "80 verify steps, 8 prompts" in line and "validation recorded 0.80 / 0.70 / 0.60" in line
    assert len(stub.requests) == 8 and all(r["temperature"] == 0 and r["max_tokens"] == 16 for r in stub.requests)

    with EngineStub(engine, [SERVED_BROKEN]) as stub:
        code = main(["check", str(drafter), "--endpoint", stub.url, "--engine", engine, "--num-prompts", "8"])
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "served-acceptance" in ln]
    assert code == 1 and line.startswith("ERROR") and "likely causes: aux-layer ids" in line
    assert out.strip().splitlines()[-1].startswith("FAILED: 1 error(s)")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_too_few_verify_steps_is_no_verdict_with_its_own_exit_status(engine, drafter, capsys):
    """2 prompts of 10 verify steps reach position 2 16 times (3: 12), short of the 20 needed: no pass, no failure,
    exit 3; --min-verify-steps 5 judges the same counts (position 3 then needs the 9 at which a served 0 would fail)."""
    argv = ["check", str(drafter), "--engine", engine, "--num-prompts", "2"]
    with EngineStub(engine, [SERVED_WELL]) as stub:
        code = main(argv + ["--endpoint", stub.url])
    out = capsys.readouterr().out.strip().splitlines()
    (line,) = [ln for ln in out if "served-acceptance" in ln]
    assert code == NO_VERDICT == 3 and line.startswith("WARNING") and "not enough evidence for a verdict" in line
    assert out[-1].startswith("not enough evidence: ask more prompts (position 2 was reached by 16 verify step(s) "
                              "of 2 prompt(s), 20 needed (--num-prompts, about 3 prompts")
    with EngineStub(engine, [SERVED_WELL]) as stub:
        assert main(argv + ["--endpoint", stub.url, "--min-verify-steps", "5"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("OK: 0 error(s)")
    # nothing accepted in 2 verify steps is not a failure either (it was a pass before this rule)
    with EngineStub(engine, [[0, 0]]) as stub:
        assert main(argv[:-1] + ["1", "--endpoint", stub.url]) == NO_VERDICT
    assert "position 1 was reached by 2 verify step(s)" in capsys.readouterr().out


def test_zero_verify_steps_is_no_verdict(drafter, capsys):
    with EngineStub("vllm", [[]]) as stub:
        assert main(["check", str(drafter), "--endpoint", stub.url, "--num-prompts", "3"]) == NO_VERDICT
    out = capsys.readouterr().out
    assert "0 verify steps, 3 prompts" in out and "within" not in out and "beyond chance" not in out
    assert out.strip().splitlines()[-1].startswith("not enough evidence: ask more prompts (position 1 was reached "
                                                   "by 0 verify step(s) of 3 prompt(s), 20 needed (--num-prompts, or")


def test_a_server_without_a_drafter_or_no_server_is_one_line(drafter, capsys, tmp_path):
    with EngineStub("vllm", [SERVED_WELL], vllm_drafts=False) as stub:
        code = main(["check", str(drafter), "--endpoint", stub.url, "--num-prompts", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith(f"error: vLLM at {stub.url} reports no speculative-decoding counters")
    url = stub.url  # stopped: nothing listens there now
    code = main(["check", str(drafter), "--endpoint", url, "--engine", "vllm", "--num-prompts", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith(f"error: no server answers at {url}")
    (drafter / "eagle3_training.json").unlink()
    code = main(["check", str(drafter), "--endpoint", url, "--num-prompts", "1"])
    assert code == 1 and "has no eagle3_training.json" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_check_endpoint_renders_in_the_thinking_mode_the_drafter_was_trained_in(engine, tmp_path, capsys):
    """A drafter trained on text rendered with {"thinking": true} is measured on that mode: every request carries
    its recorded kwargs, whatever the server's default; a drafter that recorded none sends none."""
    trained = write_drafter(tmp_path / "thinking", verifier_chat_template_kwargs={"thinking": True})
    plain = write_drafter(tmp_path / "plain")
    for path in (trained, plain):
        (path / "eagle3_training.json").write_text(json.dumps({"metrics": {"step_conditional_accuracy": RECORDED}}))
    with EngineStub(engine, [SERVED_WELL]) as stub:
        assert main(["check", str(trained), "--endpoint", stub.url, "--engine", engine, "--num-prompts", "8"]) == 0
    assert len(stub.requests) == 8 and all(r["chat_template_kwargs"] == {"thinking": True} for r in stub.requests)
    assert 'chat_template_kwargs {"thinking": true}' in capsys.readouterr().err
    with EngineStub(engine, [SERVED_WELL]) as stub:
        assert main(["check", str(plain), "--endpoint", stub.url, "--engine", engine, "--num-prompts", "8"]) == 0
    assert stub.requests and all("chat_template_kwargs" not in r for r in stub.requests)
