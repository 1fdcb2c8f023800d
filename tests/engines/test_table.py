"""The serving engines' and drafter kinds' table (eagle3_hf/engines/table.py) and the places that read it: a
checkpoint's kind from its `architectures`, each engine's name for it in the serve commands, the vLLM runner's
speculative method, llama-server's --spec-type, the engines `evaluate --engine` runs, `check --engine` knows and the
live check reads. No engine is needed."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from eagle3_hf.engines import table
from eagle3_hf.engines.llamacpp_server import LlamaServer
from eagle3_hf.engines.table import DFLASH, EAGLE3, checkpoint_kind, drafter_kind
from eagle3_hf.engines.vllm.vllm_env import RUNNER
from eagle3_hf.errors import UsageError
from eagle3_hf.evaluation import command, live_check
from eagle3_hf.publish import report
from eagle3_hf.publish.model_card import build_model_card, serve_commands


@pytest.mark.parametrize("architectures, kind", [
    (["LlamaForCausalLMEagle3"], "eagle3"), (["Eagle3LlamaForCausalLM"], "eagle3"), (["Eagle3Speculator"], "eagle3"),
    (["LlamaForCausalLM"], "eagle3"), (None, "eagle3"), (["DFlashDraftModel"], "dflash"),
])
def test_a_checkpoint_s_kind_is_read_from_its_architectures(architectures, kind, tmp_path):
    config = {} if architectures is None else {"architectures": architectures}
    assert drafter_kind(config).name == kind
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert checkpoint_kind(tmp_path).name == kind


def test_each_kind_has_its_name_in_each_engine():
    assert (EAGLE3.vllm_method, EAGLE3.sglang_algorithm, EAGLE3.llamacpp_spec_type) == ("eagle3", "EAGLE3",
                                                                                        "draft-eagle3")
    assert (DFLASH.vllm_method, DFLASH.sglang_algorithm, DFLASH.llamacpp_spec_type) == ("dflash", "DFLASH",
                                                                                        "draft-dflash")


def test_each_kind_s_row_names_what_the_package_does_with_it_by_kind(monkeypatch):
    """The decoder, the plan's arithmetic and check's rules are found through the row: a kind whose row names
    other functions gets those, so nothing else picks by the kind's name."""
    import inspect

    from eagle3_hf.decoding import speculative_decode
    from eagle3_hf.decoding.kind_decoders import decode_blocks, decode_chain_or_tree
    from eagle3_hf.publish.check import check_dflash, check_eagle3
    from eagle3_hf.train.plan_drafter import dflash_arithmetic, drafter_arithmetic, eagle3_arithmetic

    rows = {EAGLE3: (decode_chain_or_tree, eagle3_arithmetic, check_eagle3),
            DFLASH: (decode_blocks, dflash_arithmetic, check_dflash)}
    assert set(rows) == set(table.KINDS)
    for row, expected in rows.items():
        assert (row.decoder_function(), row.plan_function(), row.checks_function()) == expected
        assert row.model_class().drafter_kind == row.name  # the model says which row it is
    decoders = [inspect.signature(f) for f, _, _ in rows.values()]
    assert [list(s.parameters) for s in decoders] == [list(decoders[0].parameters)] * len(decoders)
    assert list(decoders[0].parameters)[3:] == list(inspect.signature(speculative_decode).parameters)[3:]

    swapped = tuple(table.DrafterKind(**{**vars(k), "plan": f"{__name__}:stand_in_arithmetic"}) if k is EAGLE3 else k
                    for k in table.KINDS)
    monkeypatch.setattr(table, "KINDS", swapped)
    assert drafter_arithmetic({"drafter_kind": "eagle3"}, {}, 8) == ("stand-in", 8)


def stand_in_arithmetic(recipe, text_cfg, draft_vocab):
    return "stand-in", draft_vocab


def test_the_engine_lists_are_the_table_s():
    assert report.ENGINES == table.engine_names() == ("sglang", "vllm", "llamacpp")
    assert report.SERVERS == table.checkpoint_engines() == ("sglang", "vllm")  # `check --engine all`
    assert set(command.RUNNERS) == set(table.evaluated_engines()) == {"vllm", "llamacpp"}
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    choices = next(a.choices for a in parser._actions if a.dest == "engine")
    assert list(choices) == ["transformers", *table.evaluated_engines()]
    assert table.live_engines() == ("sglang", "vllm")


def test_evaluate_runs_the_engine_it_is_asked_for(monkeypatch):
    ran = []
    monkeypatch.setitem(command.RUNNERS, "llamacpp", lambda args: ran.append(args.engine) or 7)
    assert command.run(argparse.Namespace(engine="llamacpp")) == 7 and ran == ["llamacpp"]


def test_the_live_check_refuses_an_engine_it_cannot_read_before_any_request():
    with pytest.raises(UsageError, match="reads SGLang or vLLM counters, not llama.cpp's"):
        live_check.measure("http://127.0.0.1:9", ["hi"], 4, engine="llamacpp")


def test_serve_commands_name_the_kind_s_algorithm_in_each_engine():
    eagle = serve_commands("org/verifier", "org/drafter")
    assert "--speculative-algorithm EAGLE3 " in eagle["sglang"] and '"method": "eagle3"' in eagle["vllm"]
    dflash = serve_commands("org/verifier", "org/drafter", kind=DFLASH, block_size=16)
    assert dflash["sglang"].endswith("--speculative-algorithm DFLASH --speculative-num-draft-tokens 16")
    assert '"method": "dflash"' in dflash["vllm"] and '"num_speculative_tokens": 15' in dflash["vllm"]


def test_a_dflash_card_serves_it_as_dflash_in_every_engine(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                                                      "dflash_config": {"block_size": 8, "mask_token_id": 0}}))
    (tmp_path / "dflash-drafter-f16.gguf").write_bytes(b"GGUF")
    card = str(build_model_card(tmp_path, "org/drafter"))
    assert "--speculative-algorithm DFLASH --speculative-num-draft-tokens 8" in card
    assert '"method": "dflash"' in card and "--spec-type draft-dflash" in card and "# DFlash drafter for" in card
    assert not [name for name in ("EAGLE3", '"eagle3"', "draft-eagle3", "- eagle3") if name in card]


def test_llama_server_drafts_with_the_kind_s_spec_type(tmp_path):
    build = types.SimpleNamespace(server=Path("llama-server"))
    plain = LlamaServer(build, tmp_path / "v.gguf", tmp_path / "log")
    assert "--spec-type" not in plain.argv()
    for kind in (EAGLE3, DFLASH):
        argv = LlamaServer(build, tmp_path / "v.gguf", tmp_path / "log", draft=tmp_path / "d.gguf",
                           spec_type=kind.llamacpp_spec_type).argv()
        assert argv[argv.index("--spec-type") + 1] == kind.llamacpp_spec_type
    argv = LlamaServer(build, tmp_path / "v.gguf", tmp_path / "log", draft=tmp_path / "d.gguf").argv()
    assert argv[argv.index("--spec-type") + 1] == "draft-eagle3"  # the default, as before the table


def test_the_vllm_runner_asks_vllm_for_the_request_s_method(monkeypatch):
    """vllm_runner.py imports nothing of the package: the method comes in its request, as the caller took it from
    the table. A stand-in vllm module records what the runner builds its engines with."""
    built = []

    class LLM:
        def __init__(self, **kwargs):
            built.append(kwargs)

    fake = types.ModuleType("vllm")
    fake.__version__, fake.LLM, fake.SamplingParams = "0.0-stub", LLM, object
    inputs, platforms = types.ModuleType("vllm.inputs"), types.ModuleType("vllm.platforms")
    inputs.TokensPrompt = dict
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: True)
    for name, module in (("vllm", fake), ("vllm.inputs", inputs), ("vllm.platforms", platforms)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.syspath_prepend(str(RUNNER.parent))  # the runner imports vllm_args beside it, by name
    spec = importlib.util.spec_from_file_location("vllm_runner_script", RUNNER)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    for kind in (EAGLE3, DFLASH):
        built.clear()
        runner.run({"verifier": "v", "drafter": "d", "method": kind.vllm_method, "k": 3, "prompts": [],
                    "max_new_tokens": 4})
        plain, spec_engine = built
        assert "speculative_config" not in plain
        assert spec_engine["speculative_config"] == {"method": kind.vllm_method, "model": "d",
                                                     "num_speculative_tokens": 3}
