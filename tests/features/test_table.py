"""The table owns the front door: `extract --engine`'s choices, the route `--engine`/`--endpoint` select and
`train --features`' syntax are made from SOURCES' rows, so a row's spellings and the parser cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from eagle3_hf.errors import UsageError
from eagle3_hf.features import table
from eagle3_hf.features.routes.extract import add_arguments
from eagle3_hf.features.table import SOURCES, FeatureSpec, engine_kind, engines, features_syntax


def engine_choices() -> list[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return list(next(a for a in parser._actions if a.dest == "engine").choices or [])


def test_extract_engine_choices_are_the_rows_engines():
    assert engine_choices() == engines() == ["transformers", "vllm", "sglang"]


def test_engine_and_endpoint_select_the_row():
    assert [engine_kind(e, p) for e in engines() for p in (False, True)] == [
        "transformers", "transformers", "vllm", "vllm-server", "sglang-server", "sglang-server"]
    with pytest.raises(UsageError, match="--engine trt: one of transformers, vllm, sglang"):
        engine_kind("trt", False)


def test_a_new_row_is_an_engine_choice_and_a_features_spelling(monkeypatch):
    row = dataclasses.replace(SOURCES["vllm"], kind="trt", engine="trt", features="trt:URL (a test route)")
    monkeypatch.setitem(table.SOURCES, "trt", row)
    assert engine_choices()[-1] == "trt" and engine_kind("trt", False) == "trt"
    assert features_syntax().endswith(", or trt:URL (a test route)")


def test_every_features_spelling_parses_to_its_row():
    examples = {"transformers": "hf:some/verifier", "server": "http://h:1", "sglang-server": "sglang:http://h:1",
                "directory": "runs/features"}
    spelled = {kind for kind, row in SOURCES.items() if row.features}
    assert spelled == set(examples)
    for kind in spelled:
        assert FeatureSpec.parse(examples[kind]).kind == kind
        assert SOURCES[kind].features.split(" (")[0] in FeatureSpec.SYNTAX  # type: ignore[union-attr]
