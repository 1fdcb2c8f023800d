"""The table of feature sources: every `extract --engine` value and every `train --features` value resolves here.

A row names the module that implements the route (imported only when the route is opened: vLLM's routes need
nothing of vLLM in this venv until then), the opener the table calls (`open_source(request) -> FeatureSource`),
and which half of the pipeline uses it: `offline` (a command writes its features to shards through
`write.write_features`) and `online` (`train --features` computes them while training through
`collator.FeatureCollator`). A feature directory is a row too: training reads its shards directly
(reader.FeatureDataset), and as a source it re-serves what it stores.

A row also gives the route's spellings: its `extract --engine` value (and whether `--endpoint` selects it), its
`train --features` spelling and a one-line summary. `extract --engine`'s choices, `train --features`' syntax in
its refusals and docs/development.md's route table (scripts/cli_reference.py) are made from these rows, so a new
route is listed everywhere by its row alone.

Adding an engine is one module in `routes/` with `open_source`, one row here, and the contract test
(tests/features/test_sources_contract.py), which runs over every row (docs/development.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar, Literal, cast, get_args

from ..errors import UsageError
from .interface import FeatureSource

FeatureKind = Literal["transformers", "vllm", "vllm-server", "sglang-server", "server", "directory", "speculators",
                      "specforge"]


@dataclass(frozen=True)
class SourceRequest:
    """What a route is opened with: the kind (a row of SOURCES), its target (a directory, a URL, a verifier), the
    verifier and its revision, the aux layer indices (None: the verifier's default), the storage dtype, the
    tokenizer fingerprint of the prepared samples, and the route's own options record (or None)."""

    kind: FeatureKind
    target: str = ""
    verifier: str = ""
    revision: str | None = None
    aux_indices: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    trust_remote_code: bool = False
    tokenizer_fingerprint: str = ""
    options: Any = None


@dataclass(frozen=True)
class OnlineOptions:
    """What `train --features` hands every online route as `SourceRequest.options`: the prepared directory (named
    in refusals), and the seconds and retries of one request where the route makes requests."""

    prepared_dir: str = ""
    timeout: float = 600.0
    retries: int = 3


@dataclass(frozen=True)
class SourceRow:
    """One route: `module` defines `opener` (request -> FeatureSource) and, where the route's target names a
    verifier (`train --features X` without --verifier), `names_verifier` (target -> (name, revision))."""

    kind: FeatureKind
    module: str
    offline: bool  # written to shards through write.write_features (extract, import-features)
    online: bool  # computed while training through collator.FeatureCollator (train --features)
    selected_by: str
    opener: str = "open_source"
    names_verifier: str | None = None
    options_from_args: str | None = None  # the route's typed options from a command's arguments (a dotted name)
    online_rounding: bool = False  # online batches rounded to --features-dtype (default bf16); else kept as computed
    remote: bool = False  # another process computes them (a URL): its identity is checked, loader workers on a CPU
    summary: str = ""  # one line: what computes the states (the docs' route table)
    engine: str | None = None  # its `extract --engine` value; None where extract does not run it
    endpoint: bool = False  # `extract --engine ENGINE --endpoint URL` selects it (else ENGINE alone does)
    features: str | None = None  # its `train --features` spelling, with what it is (the refusals' syntax)

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


SOURCES: dict[str, SourceRow] = {row.kind: row for row in (
    SourceRow("transformers", "eagle3_hf.features.routes.extract", offline=True, online=True,
              selected_by="extract (--engine transformers); train --features hf[:VERIFIER]",
              names_verifier="named_verifier", engine="transformers",
              summary="the verifier in this process, through forward hooks",
              features="`hf` or `hf:VERIFIER` (the verifier in the training process, nothing on disk; with "
                       "--prepared-dir)"),
    SourceRow("vllm", "eagle3_hf.features.routes.vllm_offline", offline=True, online=False,
              selected_by="extract --engine vllm", options_from_args="VllmOptions.from_args", engine="vllm",
              summary="vLLM's extract_hidden_states in its own venv; the verifier's norm and lm_head here"),
    SourceRow("vllm-server", "eagle3_hf.features.routes.vllm_offline", offline=True, online=False,
              selected_by="extract --engine vllm --endpoint URL", options_from_args="VllmOptions.from_args",
              engine="vllm", endpoint=True,
              summary="a running vLLM OpenAI server started by `serve-vllm`; its storage directory read here"),
    SourceRow("server", "eagle3_hf.features.routes.feature_server", offline=False, online=True,
              selected_by="train --features http://HOST:PORT", names_verifier="served_verifier",
              online_rounding=True, remote=True, summary="our feature server (`serve-features`: vLLM kept loaded)",
              features="http://HOST:PORT (a feature server started by `eagle3-hf serve-features`; with "
                       "--prepared-dir)"),
    SourceRow("sglang-server", "eagle3_hf.features.routes.sglang_server", offline=True, online=True,
              selected_by="extract --engine sglang --endpoint URL; train --features sglang:http://HOST:PORT",
              names_verifier="served_model", options_from_args="SglangOptions.from_args", online_rounding=True,
              remote=True, engine="sglang", endpoint=True,
              summary="a running SGLang server's aux hidden states; the verifier's last layer, norm and lm_head here",
              features="sglang:http://HOST:PORT (a running SGLang server started with aux capture; with "
                       "--prepared-dir)"),
    SourceRow("directory", "eagle3_hf.features.reader", offline=False, online=False,
              selected_by="train --features DIR (its shards read directly)", names_verifier="recorded_verifier",
              summary="a feature directory written by any offline route; training reads its shards directly",
              features="a feature directory (from `eagle3-hf extract`)"),
    SourceRow("speculators", "eagle3_hf.features.routes.imports", offline=True, online=False,
              selected_by="import-features speculators",
              summary="hidden states written by speculators (vLLM's speculators), imported"),
    SourceRow("specforge", "eagle3_hf.features.routes.imports", offline=True, online=False,
              selected_by="import-features specforge",
              summary="hidden states written by SGLang's SpecForge, imported"),
)}
assert set(SOURCES) == set(get_args(FeatureKind)), "every FeatureKind is a row of SOURCES"


def source_row(kind: str) -> SourceRow:
    try:
        return SOURCES[kind]
    except KeyError:
        raise UsageError(f"no feature source {kind!r}: one of {', '.join(SOURCES)}") from None


def engines() -> list[str]:
    """`extract --engine`'s choices, in the table's order."""
    return list(dict.fromkeys(row.engine for row in SOURCES.values() if row.engine is not None))


def engine_kind(engine: str, endpoint: bool) -> FeatureKind:
    """The route `extract --engine ENGINE [--endpoint URL]` selects: the engine's row that `--endpoint` selects (or
    not); an engine with one row only (SGLang needs its endpoint) is that row, whose options refuse what is missing."""
    rows = [row for row in SOURCES.values() if row.engine == engine]
    if not rows:
        raise UsageError(f"--engine {engine}: one of {', '.join(engines())}")
    return next((row for row in rows if row.endpoint == endpoint), rows[0]).kind


def features_syntax() -> str:
    """`train --features`' spellings, from the rows that have one: a directory first, then the table's order."""
    rows = sorted((row for row in SOURCES.values() if row.features), key=lambda row: row.kind != "directory")
    spellings = [row.features for row in rows if row.features]
    return ", ".join(spellings[:-1]) + ", or " + spellings[-1]


def open_source(request: SourceRequest) -> FeatureSource:
    """The route of `request.kind`, opened (its module imported now)."""
    row = source_row(request.kind)
    opener = getattr(row.load(), row.opener, None)
    if opener is None:
        raise NotImplementedError(f"{row.module} defines no {row.opener}(request): the {row.kind} route is not a "
                                  "FeatureSource yet")
    return cast(FeatureSource, opener(request))


def options_from_args(kind: str, args: Any) -> Any:
    """The typed options record of the route of `kind` (SourceRequest.options), read from a command's parsed
    arguments by the route's own reader (its row's `options_from_args`); None where the route has none."""
    row = source_row(kind)
    if row.options_from_args is None:
        return None
    reader: Any = row.load()
    for name in row.options_from_args.split("."):
        reader = getattr(reader, name)
    return reader(args)


@dataclass(frozen=True)
class FeatureSpec:
    """Where training reads its features (`train --features`): a feature directory, the verifier in the training
    process, a feature server, or a running SGLang server."""

    kind: FeatureKind  # "directory", "transformers", "server" or "sglang-server"
    target: str  # the directory; the verifier ("" means --verifier); the server's URL

    SYNTAX: ClassVar[str] = features_syntax()

    @classmethod
    def parse(cls, value: str) -> FeatureSpec:
        value = str(value).strip()
        if not value:
            raise ValueError(f"--features is empty: pass {cls.SYNTAX}")
        if value.startswith(("http://", "https://")):
            return cls("server", value.rstrip("/"))
        if value.startswith("sglang:"):
            url = value[len("sglang:"):].rstrip("/")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--features {value}: sglang: takes the server's URL, sglang:http://HOST:PORT")
            return cls("sglang-server", url)
        if value == "hf" or value.startswith("hf:"):
            return cls("transformers", value[3:])
        return cls("directory", value)

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
