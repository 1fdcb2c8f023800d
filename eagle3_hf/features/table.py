"""The table of feature sources: every `extract --engine`, `import-features` and `train --features` value resolves here.

A row names the module that implements the route, the opener the table calls (`open_source(request) ->
FeatureSource`), the route's options class (a `RouteOptions`: the flags `extract` shows in the route's own group,
read and checked once into its typed record) and which half of the pipeline uses it: `offline` (a command writes
its features to shards through `write.write_features`) and `online` (`train --features` computes them while
training through `collator.FeatureCollator`). A feature directory is a row too: training reads its shards
directly (reader.FeatureDataset), and as a source it re-serves what it stores. A route's module is imported when
the route is opened or its flags are added, and imports nothing of its engine until opened (vLLM runs in its own
venv; tests/features/test_table.py holds every route to that).

A row also gives the route's spellings: its `extract --engine` value (and whether `--endpoint` selects it), its
`train --features` prefix and target, whether `import-features` names it, and a one-line summary. `extract
--engine`'s choices, help and flag groups, `import-features`' formats, `FeatureSpec.parse`, `train --features`'
syntax in its refusals and docs/cli.md's route table (scripts/cli_reference.py) are made from these rows, so a
new route is listed everywhere by its row alone.

Adding an engine is one module in `routes/` with `open_source` and its options class, one row here, and the
contract test (tests/features/test_sources_contract.py), which runs over every row (docs/development.md).
An engine that answers conversations (`regenerate --engine`) is a row of the other table, generators.py.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, Literal, cast, get_args

from ..errors import UsageError
from .interface import FeatureSource, RouteOptions

FeatureKind = Literal["transformers", "vllm", "vllm-server", "sglang-server", "server", "directory", "speculators",
                      "specforge"]


@dataclass(frozen=True)
class SourceRequest:
    """What a route is opened with: the kind (a row of SOURCES), its target (a directory, a URL, a verifier), the
    verifier and its revision, the aux layer indices (None: the verifier's default), the storage dtype, the
    tokenizer fingerprint of the prepared samples, and the route's own options record (its row's `options` class,
    `OnlineOptions` from `train --features`, or None: the route's defaults). A route takes the record it knows
    (isinstance) and its defaults otherwise."""

    kind: FeatureKind
    target: str = ""
    verifier: str = ""
    revision: str | None = None
    aux_indices: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    tokenizer_fingerprint: str = ""
    options: object = None


@dataclass(frozen=True)
class OnlineOptions:
    """What `train --features` hands every online route as `SourceRequest.options`: the prepared directory (named
    in refusals), and the seconds and retries of one request where the route makes requests."""

    prepared_dir: str = ""
    timeout: float = 600.0
    retries: int = 3


Target = Literal["verifier", "url", "directory"]


@dataclass(frozen=True)
class SourceRow:
    """One route: `module` defines `opener` (request -> FeatureSource), its `options` class (a RouteOptions: the
    flags `extract` shows in the route's group, read into its typed record) and, where the route's target names a
    verifier (`train --features X` without --verifier), `names_verifier` (target -> (name, revision)).

    Its spellings: `engine` is its `extract --engine` value (`endpoint`: selected with --endpoint URL); `prefix`
    and `target` its `train --features` value (`PREFIX:TARGET`, or the bare target where there is no prefix: a
    URL, a directory; a verifier may be left out, `hf`), `features` saying what it is (train --features' help and
    refusals); `imported`: it is `import-features KIND`."""

    kind: FeatureKind
    module: str
    offline: bool  # written to shards through write.write_features (extract, import-features)
    online: bool  # computed while training through collator.FeatureCollator (train --features)
    summary: str  # one line: what computes the states (extract --help, the docs' route table)
    opener: str = "open_source"
    options: str | None = None  # the class (in `module`) of its options record, a RouteOptions
    names_verifier: str | None = None
    online_rounding: bool = False  # online batches rounded to --features-dtype (default bf16); else kept as computed
    remote: bool = False  # another process computes them (a URL): its identity is checked, loader workers on a CPU
    engine: str | None = None
    endpoint: bool = False
    prefix: str | None = None
    target: Target | None = None  # None: train --features cannot name it
    features: str = ""  # what `train --features SPELLING` is, after the spelling (`spelling`)
    imported: bool = False

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)

    @property
    def spelling(self) -> str:
        """Its `train --features` value, in short ("" where training cannot name it)."""
        if self.target is None:
            return ""
        word = {"verifier": "VERIFIER", "url": "http://HOST:PORT", "directory": "DIR"}[self.target]
        if self.prefix is None:
            return word
        return f"{self.prefix}[:{word}]" if self.target == "verifier" else f"{self.prefix}:{word}"

    @property
    def selected_by(self) -> str:
        """The commands that run it, as a user types them."""
        found = [f"extract --engine {self.engine}{' --endpoint URL' if self.endpoint else ''}"] if self.engine else []
        found += [f"import-features {self.kind}"] if self.imported else []
        return "; ".join(found + ([f"train --features {self.spelling}"] if self.spelling else []))


SOURCES: dict[str, SourceRow] = {row.kind: row for row in (
    SourceRow("transformers", "eagle3_hf.features.routes.transformers", offline=True, online=True,
              summary="the verifier in this process, through forward hooks", options="TransformersOptions",
              names_verifier="named_verifier", engine="transformers", prefix="hf", target="verifier",
              features="the verifier in the training process, nothing on disk; with --prepared-dir"),
    SourceRow("vllm", "eagle3_hf.features.routes.vllm_offline", offline=True, online=False,
              summary="vLLM's extract_hidden_states in its own venv; the verifier's norm and lm_head here",
              options="VllmOptions", engine="vllm"),
    SourceRow("vllm-server", "eagle3_hf.features.routes.vllm_server_client", offline=True, online=False,
              summary="a running vLLM OpenAI server started by `serve-vllm`; its storage directory read here",
              options="VllmOptions", engine="vllm", endpoint=True),
    SourceRow("server", "eagle3_hf.features.routes.feature_server_client", offline=False, online=True,
              summary="our feature server (`serve-features`: vLLM kept loaded)", names_verifier="served_verifier",
              online_rounding=True, remote=True, target="url",
              features="a feature server started by `eagle3-hf serve-features`; with --prepared-dir"),
    SourceRow("sglang-server", "eagle3_hf.features.routes.sglang_server_client", offline=True, online=True,
              summary="a running SGLang server's aux hidden states; the verifier's last layer, norm and lm_head here",
              options="SglangOptions", names_verifier="served_model", online_rounding=True, remote=True,
              engine="sglang", endpoint=True, prefix="sglang", target="url",
              features="a running SGLang server started with aux capture; with --prepared-dir"),
    SourceRow("directory", "eagle3_hf.features.routes.directory", offline=False, online=False,
              summary="a feature directory written by any offline route; training reads its shards directly",
              names_verifier="recorded_verifier", target="directory",
              features="a feature directory, from `eagle3-hf extract`"),
    SourceRow("speculators", "eagle3_hf.features.routes.engine_files", offline=True, online=False,
              summary="hidden states written by speculators (vLLM's speculators), imported", options="ImportOptions",
              imported=True),
    SourceRow("specforge", "eagle3_hf.features.routes.engine_files", offline=True, online=False,
              summary="hidden states written by SGLang's SpecForge, imported", options="ImportOptions", imported=True),
)}
assert set(SOURCES) == set(get_args(FeatureKind)), "every FeatureKind is a row of SOURCES"


def is_url(value: str) -> bool:
    return value.startswith(("http://", "https://"))


def source_row(kind: str) -> SourceRow:
    try:
        return SOURCES[kind]
    except KeyError:
        raise UsageError(f"no feature source {kind!r}: one of {', '.join(SOURCES)}") from None


def engines() -> list[str]:
    """`extract --engine`'s choices, in the table's order."""
    return list(dict.fromkeys(row.engine for row in SOURCES.values() if row.engine is not None))


def endpoint_engines() -> list[str]:
    """The engines `extract --endpoint URL` works with."""
    return [engine for engine in engines() if any(r.engine == engine and r.endpoint for r in SOURCES.values())]


def extract_kinds() -> list[FeatureKind]:
    """The routes `extract --engine` runs, in the table's order."""
    return [row.kind for row in SOURCES.values() if row.engine is not None]


def imported_formats() -> list[FeatureKind]:
    """`import-features`' formats, in the table's order."""
    return [row.kind for row in SOURCES.values() if row.imported]


def engine_kind(engine: str, endpoint: bool) -> FeatureKind:
    """The route `extract --engine ENGINE [--endpoint URL]` selects: the engine's row that `--endpoint` selects (or
    not); an engine with one row only (SGLang needs its endpoint) is that row, whose options refuse what is missing."""
    rows = [row for row in SOURCES.values() if row.engine == engine]
    if not rows:
        raise UsageError(f"--engine {engine}: one of {', '.join(engines())}")
    if endpoint and not any(row.endpoint for row in rows):
        raise UsageError(f"--endpoint URL needs --engine {' or --engine '.join(endpoint_engines())} (a running "
                         f"server computes the states); --engine {engine} runs no server")
    return next((row for row in rows if row.endpoint == endpoint), rows[0]).kind


def engine_help() -> str:
    """`extract --engine`'s help: what computes the states for each value, from the rows' summaries."""
    parts = []
    for engine in engines():
        rows = [row for row in SOURCES.values() if row.engine == engine]
        said = [row.summary for row in rows if not row.endpoint]
        said += [f"with --endpoint URL{'' if said else ' (required)'}, {row.summary}" for row in rows if row.endpoint]
        parts.append(f"{engine}: {'; '.join(said)}")
    return ". ".join(parts) + " (default: %(default)s)"


def features_syntax() -> str:
    """`train --features`' spellings and what each is, from the rows that have one: a directory first, then the
    table's order (train --help, and the flag's refusals)."""
    rows = sorted((row for row in SOURCES.values() if row.spelling), key=lambda row: row.target != "directory")
    spellings = [f"{row.spelling} ({row.features})" for row in rows]
    return ", ".join(spellings[:-1]) + ", or " + spellings[-1]


def open_source(request: SourceRequest) -> FeatureSource:
    """The route of `request.kind`, opened (its module imported now)."""
    row = source_row(request.kind)
    opener = getattr(row.load(), row.opener, None)
    if opener is None:
        raise NotImplementedError(f"{row.module} defines no {row.opener}(request): the {row.kind} route is not a "
                                  "FeatureSource yet")
    return cast(FeatureSource, opener(request))


def route_options(kind: str) -> type[RouteOptions] | None:
    """The options class of the route of `kind` (its module imported now); None where the route has none."""
    row = source_row(kind)
    if row.options is None:
        return None
    options = getattr(row.load(), row.options, None)
    if options is None:
        raise NotImplementedError(f"{row.module} defines no {row.options}: the {row.kind} row names it")
    return cast("type[RouteOptions]", options)


def add_route_arguments(parser: argparse.ArgumentParser, kinds: Iterable[str]) -> None:
    """The flags of the routes of `kinds` (the ones a command runs), each options class's group once, in order."""
    added: list[type[RouteOptions]] = []
    for kind in kinds:
        options = route_options(kind)
        if options is not None and options not in added:
            options.add_arguments(parser)
            added.append(options)


def options_from_args(kind: str, args: argparse.Namespace) -> RouteOptions | None:
    """The typed options record of the route of `kind` (SourceRequest.options), read and checked from a command's
    parsed arguments by the route's own class; None where the route has none."""
    options = route_options(kind)
    return None if options is None else options.from_args(args)


@dataclass(frozen=True)
class FeatureSpec:
    """Where training reads its features (`train --features`): a feature directory, the verifier in the training
    process, a feature server, or a running SGLang server."""

    kind: FeatureKind  # "directory", "transformers", "server" or "sglang-server"
    target: str  # the directory; the verifier ("" means --verifier); the server's URL

    SYNTAX: ClassVar[str] = features_syntax()

    @classmethod
    def parse(cls, value: str) -> FeatureSpec:
        """The row whose spelling `value` is: `PREFIX:TARGET` (a prefix names its row; a verifier may be left out),
        else a bare URL, else a directory."""
        value = str(value).strip()
        if not value:
            raise ValueError(f"--features is empty: pass {cls.SYNTAX}")
        rows = sorted((row for row in SOURCES.values() if row.target is not None),
                      key=lambda row: (row.prefix is None, row.target == "directory"))
        for row in rows:
            if row.prefix is not None:
                if not (value.startswith(row.prefix + ":") or (value == row.prefix and row.target == "verifier")):
                    continue
                target = value[len(row.prefix) + 1:]
                if row.target == "url" and not is_url(target):
                    raise ValueError(f"--features {value}: {row.prefix}: takes the server's URL, "
                                     f"{row.prefix}:http://HOST:PORT")
                return cls(row.kind, target.rstrip("/") if row.target == "url" else target)
            if row.target == "directory" or (row.target == "url" and is_url(value)):
                return cls(row.kind, value.rstrip("/") if row.target == "url" else value)
        raise ValueError(f"--features {value}: pass {cls.SYNTAX}")  # no directory row: the table says what is

    @property
    def online(self) -> bool:
        """Computed while training (nothing on disk): the samples come from --prepared-dir."""
        return SOURCES[self.kind].online

    @property
    def remote(self) -> bool:
        """Computed by another process behind a URL (a feature server, SGLang), not by this one."""
        return SOURCES[self.kind].remote

    def named_verifier(self) -> tuple[str | None, str | None]:
        """(name, revision) of the verifier the target names; (None, None) where it names none."""
        row = SOURCES[self.kind]
        if row.names_verifier is None:
            return None, None
        found: tuple[str | None, str | None] = getattr(row.load(), row.names_verifier)(self.target)
        return found
