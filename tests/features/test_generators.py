"""`regenerate`'s front door is the answering table (features/generators.py): its --engine choices, help and flag
groups, the route --engine/--endpoint select, --features-out as a row's capability and each route's one options
record are made from GENERATORS' rows, so a new answering engine is one module and one row."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from eagle3_hf.errors import UsageError
from eagle3_hf.features import generators
from eagle3_hf.features.commands.regenerate import add_arguments, job_from_args
from eagle3_hf.features.generators import GENERATORS, check_features, engines, generator


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser()
    add_arguments(found)
    return found


def engine_choices() -> list[str]:
    return list(next(a for a in parser()._actions if a.dest == "engine").choices or [])


def test_engine_choices_are_the_rows_engines():
    assert engine_choices() == engines() == ["transformers", "vllm"]


def test_engine_and_endpoint_select_the_row():
    assert generator(None, False).name == generator("transformers", False).name == "transformers"
    assert generator("vllm", False).name == "vllm"
    assert generator(None, True).name == "endpoint"  # any server: --endpoint alone
    with pytest.raises(UsageError, match="--engine vllm runs an engine of its own: drop --endpoint"):
        generator("vllm", True)


def test_features_out_is_the_rows_capability():
    check_features(GENERATORS["transformers"], True)
    check_features(GENERATORS["transformers"], False)
    with pytest.raises(UsageError, match=r"--features-out needs a route that writes the verifier's features "
                                         r"\(--engine transformers or --engine vllm, with --verifier\); --endpoint "
                                         "URL returns no hidden states"):
        check_features(GENERATORS["endpoint"], True)
    with pytest.raises(UsageError, match="regenerate --engine vllm writes features: give --features-out"):
        check_features(GENERATORS["vllm"], False)


def test_features_out_to_an_endpoint_is_refused_before_anything_runs(tmp_path, capsys):
    from eagle3_hf import cli

    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}))
    code = cli.main(["regenerate", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                     "--endpoint", "http://127.0.0.1:9", "--model", "m", "--wait-for-server", "0", "--max-retries", "0",
                     "--features-out", str(tmp_path / "f")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: regenerate: --features-out needs a route that writes")
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "f").exists()


@dataclass(frozen=True)
class SgOptions:
    """A test route's options class, as a route module defines it."""

    requests: int = 1

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument_group("--engine sg (a test route)").add_argument("--sg-requests", type=int, default=1)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SgOptions:
        if args.sg_requests < 1:
            raise UsageError("--sg-requests must be at least 1")
        return cls(args.sg_requests)

    def close(self) -> None:
        pass


def run_route(job, options: SgOptions) -> int:
    Path(job.output).write_text(json.dumps({"requests": options.requests, "features": str(job.features)}))
    return 0


def test_a_new_row_brings_its_choice_flags_options_and_runner(monkeypatch, tmp_path):
    """An answering engine is one module + one row: its --engine value, its group in `regenerate --help`, its record
    read and checked once from the arguments, its runner given the job and the record, with nothing else edited."""
    from eagle3_hf import cli

    module = type(sys)("sg_route")
    module.SgOptions = SgOptions  # type: ignore[attr-defined]
    module.run_route = run_route  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sg_route", module)
    row = generators.GeneratorRow("sg", "sg_route", "SgOptions", summary="a test engine", engine="sg",
                                  features="optional")
    monkeypatch.setitem(generators.GENERATORS, "sg", row)
    assert engine_choices()[-1] == "sg"
    help_text = parser().format_help()
    assert "--engine sg (a test route)" in help_text and "sg: a test engine" in help_text
    argv = ["--input", "i", "--output", str(tmp_path / "o.json"), "--verifier", "v", "--engine", "sg",
            "--sg-requests", "3", "--features-out", str(tmp_path / "f")]
    args = parser().parse_args(argv)
    assert generator(args.engine, False) == row and job_from_args(args).features == tmp_path / "f"
    assert cli.main(["regenerate", *argv]) == 0
    assert json.loads((tmp_path / "o.json").read_text()) == {"requests": 3, "features": str(tmp_path / "f")}
    assert cli.main(["regenerate", *argv[:-4], "--sg-requests", "0"]) == 1  # its own check, before it runs
