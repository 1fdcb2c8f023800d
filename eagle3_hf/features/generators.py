"""The table of answering routes: every `regenerate --engine` value (and `--endpoint`) resolves here.

`regenerate` has the verifier (or a server) answer the conversations again; some routes also write the features
of prompt + answer in the same pass (`--features-out`, with `--prepared-out` the prepared dataset), which replaces
`prepare` + `extract`. A row names the module that implements the route, its options class (a `RouteOptions`,
interface.py: the flags `regenerate` shows in the route's own group, read and checked once into its typed record)
and the runner the command calls with the job (`data.regenerate.RegenerateJob`: the flags every route reads) and
that record. Its capabilities: the `regenerate --engine` value that selects it (None: any server, selected by
`--endpoint` alone) and whether `--endpoint URL` selects it, and whether it writes features (`features`: never,
optional: with --features-out, always: --features-out required).

Feature sources (what `extract` and `train --features` read hidden states from) are the other table, table.py.
Adding an answering engine (SGLang in process, say) is one module with its options class and runner, and one row
here: `regenerate --engine`'s choices, help and flag groups and its refusals are made from these rows
(tests/features/test_generators.py).
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from ..errors import UsageError
from .interface import RouteOptions

if TYPE_CHECKING:
    from ..data.regenerate import RegenerateJob

Features = Literal["never", "optional", "always"]


@dataclass(frozen=True)
class GeneratorRow:
    """One answering route: `module` defines its `options` class (a RouteOptions) and `runner` (job, options ->
    exit status). `engine` is its `regenerate --engine` value (None: the route of `--endpoint` whatever serves it);
    `endpoint`: selected with --endpoint URL; `features`: whether it writes the verifier's features; `summary`:
    one line, what answers (regenerate --engine's help)."""

    name: str
    module: str
    options: str
    summary: str
    engine: str | None = None
    endpoint: bool = False
    features: Features = "never"
    runner: str = "run_route"

    @property
    def selected_by(self) -> str:
        """The flags that select it, as a user types them."""
        return " ".join(([f"--engine {self.engine}"] if self.engine else []) + (["--endpoint URL"] if self.endpoint
                                                                               else []))


GENERATORS: dict[str, GeneratorRow] = {row.name: row for row in (
    GeneratorRow("transformers", "eagle3_hf.features.transformers_generation", "InProcessOptions",
                 summary="the verifier in this process (--verifier), batched; with --features-out its hidden "
                         "states are written in the same pass", engine="transformers", features="optional"),
    GeneratorRow("vllm", "eagle3_hf.features.vllm.vllm_generation", "VllmGenerationOptions",
                 summary="vLLM (its own venv) generates, prepare runs here, then the same engine prefills the "
                         "samples, as extract --engine vllm; needs --features-out", engine="vllm", features="always"),
    GeneratorRow("endpoint", "eagle3_hf.data.regenerate", "EndpointOptions",
                 summary="with --endpoint URL and no --engine, any OpenAI-compatible server answers (SGLang, vLLM, "
                         "...); no features", endpoint=True),
)}


def engines() -> list[str]:
    """`regenerate --engine`'s choices, in the table's order (the first is the default)."""
    return list(dict.fromkeys(row.engine for row in GENERATORS.values() if row.engine is not None))


def engine_help() -> str:
    """`regenerate --engine`'s help, from the rows' summaries."""
    said = [f"{row.engine}: {row.summary}" for row in GENERATORS.values() if row.engine is not None]
    said += [row.summary for row in GENERATORS.values() if row.engine is None]
    return ". ".join(said) + f" (default: {engines()[0]})"


def generator(engine: str | None, endpoint: bool) -> GeneratorRow:
    """The route `regenerate [--engine ENGINE] [--endpoint URL]` selects: --endpoint picks among the rows --endpoint
    selects (with no --engine, the one of any server), else the engine's row (no --engine: the first engine)."""
    wanted = engine if engine is not None or endpoint else engines()[0]
    for row in GENERATORS.values():
        if row.engine == wanted and row.endpoint == endpoint:
            return row
    if endpoint:
        raise UsageError(f"regenerate --engine {engine} runs an engine of its own: drop --endpoint (or drop --engine, "
                         "and any OpenAI-compatible server at --endpoint answers)")
    raise UsageError(f"regenerate --engine {engine}: one of {', '.join(engines())}")


def options_class(row: GeneratorRow) -> type[RouteOptions]:
    """The options class of `row` (its module imported now)."""
    options = getattr(importlib.import_module(row.module), row.options, None)
    if options is None:
        raise NotImplementedError(f"{row.module} defines no {row.options}: the {row.name} generator row names it")
    return cast("type[RouteOptions]", options)


def add_generator_arguments(parser: argparse.ArgumentParser) -> None:
    """Every route's own flags, each options class's group once, in the table's order."""
    added: list[type[RouteOptions]] = []
    for row in GENERATORS.values():
        options = options_class(row)
        if options not in added:
            options.add_arguments(parser)
            added.append(options)


def check_features(row: GeneratorRow, features_out: bool) -> None:
    """--features-out against the route's capability: refused where it writes none, required where it always does."""
    if features_out and row.features == "never":
        writes = [f"--engine {r.engine}" for r in GENERATORS.values() if r.features != "never" and r.engine]
        raise UsageError(f"regenerate: --features-out needs a route that writes the verifier's features "
                         f"({' or '.join(writes)}, with --verifier); {row.selected_by} returns no hidden states")
    if not features_out and row.features == "always":
        raise UsageError(f"regenerate {row.selected_by} writes features: give --features-out (and --prepared-out)")


def run_generator(row: GeneratorRow, job: RegenerateJob, options: RouteOptions) -> int:
    """The route's runner on the job and its options record; its exit status."""
    runner = getattr(importlib.import_module(row.module), row.runner)
    return int(runner(job, options) or 0)
