"""The table owns the front door: `extract --engine`'s choices, help and flag groups, the route
`--engine`/`--endpoint` select, each route's options record, `import-features`' formats, `FeatureSpec.parse` and
`train --features`' syntax are made from SOURCES' rows, so a row's spellings and the parser cannot drift apart;
and a route's module is cheap to import (the parser imports them all)."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from dataclasses import dataclass

import pytest

from eagle3_hf.errors import UsageError
from eagle3_hf.features import table
from eagle3_hf.features.commands.extract import add_arguments
from eagle3_hf.features.table import SOURCES, FeatureSpec, engine_kind, engines, features_syntax


def engine_choices() -> list[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return list(next(a for a in parser._actions if a.dest == "engine").choices or [])


def test_extract_engine_choices_are_the_rows_engines():
    assert engine_choices() == engines() == ["transformers", "vllm", "sglang"]


def test_engine_and_endpoint_select_the_row():
    assert [engine_kind(e, p) for e in engines() for p in (False, True) if (e, p) != ("transformers", True)] == [
        "transformers", "vllm", "vllm-server", "sglang-server", "sglang-server"]
    with pytest.raises(UsageError, match="--engine trt: one of transformers, vllm, sglang"):
        engine_kind("trt", False)
    with pytest.raises(UsageError, match="--endpoint URL needs --engine vllm or --engine sglang .*; --engine "
                                         "transformers runs no server"):
        engine_kind("transformers", True)


def test_a_new_row_is_an_engine_choice_and_a_features_spelling(monkeypatch):
    row = dataclasses.replace(SOURCES["vllm"], kind="trt", engine="trt", prefix="trt", target="url",
                              features="a test route")
    monkeypatch.setitem(table.SOURCES, "trt", row)
    assert engine_choices()[-1] == "trt" and engine_kind("trt", False) == "trt"
    assert features_syntax().endswith(", or trt:http://HOST:PORT (a test route)")


def test_every_features_spelling_parses_to_its_row():
    examples = {"transformers": "hf:some/verifier", "server": "http://h:1", "sglang-server": "sglang:http://h:1",
                "directory": "runs/features"}
    spelled = {kind for kind, row in SOURCES.items() if row.features}
    assert spelled == set(examples)
    for kind in spelled:
        assert FeatureSpec.parse(examples[kind]).kind == kind
        assert f"{SOURCES[kind].spelling} ({SOURCES[kind].features})" in FeatureSpec.SYNTAX
    assert FeatureSpec.parse("hf") == FeatureSpec("transformers", "")  # the training process's --verifier
    assert FeatureSpec.parse("sglang") == FeatureSpec("directory", "sglang")  # a URL's prefix alone: a directory
    with pytest.raises(ValueError, match="sglang: takes the server's URL, sglang:http://HOST:PORT"):
        FeatureSpec.parse("sglang:runs/x")


@dataclass(frozen=True)
class TrtOptions:
    """A test route's options class, as a route module defines it."""

    requests: int = 1

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument_group("--engine trt (a test route)").add_argument("--trt-requests", type=int, default=2)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TrtOptions:
        if args.trt_requests < 1:
            raise UsageError("--trt-requests must be at least 1")
        return cls(args.trt_requests)

    def close(self) -> None:
        pass


def test_a_new_row_brings_its_flags_options_and_spelling(monkeypatch):
    """A route is one module + one row: its group in `extract --help`, its record read and checked from the
    arguments, its `--features` prefix parsed, its commands listed, with nothing else edited."""
    module = type(sys)("trt_route")
    module.TrtOptions = TrtOptions  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "trt_route", module)
    row = table.SourceRow("trt", "trt_route", offline=True, online=True, summary="a test engine",
                          options="TrtOptions", engine="trt", prefix="trt", target="url", features="a test")
    monkeypatch.setitem(table.SOURCES, "trt", row)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    engine_help = next(a for a in parser._actions if a.dest == "engine").help or ""
    assert "--engine trt (a test route)" in parser.format_help() and "trt: a test engine" in engine_help
    args = parser.parse_args(["--data", "d", "--output", "o", "--engine", "trt", "--trt-requests", "3"])
    assert table.options_from_args(engine_kind(args.engine, False), args) == TrtOptions(3)
    with pytest.raises(UsageError, match="--trt-requests must be at least 1"):
        table.options_from_args("trt", parser.parse_args(["--data", "d", "--output", "o", "--trt-requests", "0"]))
    assert FeatureSpec.parse("trt:http://h:1/") == FeatureSpec("trt", "http://h:1")  # type: ignore[arg-type]
    assert row.selected_by == "extract --engine trt; train --features trt:http://HOST:PORT"


def test_every_route_module_imports_no_engine_or_model_library():
    """`extract --help` imports every route's module (its flags): none may pull in vLLM, SGLang, transformers or
    datasets before the route is opened (vLLM runs in its own venv; a refusal must cost nothing)."""
    code = ("import argparse, sys\n"
            "from eagle3_hf.features.table import SOURCES\n"
            "from eagle3_hf.features.commands.extract import add_arguments\n"
            "[row.load() for row in SOURCES.values()]\n"
            "add_arguments(argparse.ArgumentParser())\n"
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'sglang', 'transformers', "
            "'datasets', 'deepspeed', 'accelerate'})))")
    heavy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert heavy == []
