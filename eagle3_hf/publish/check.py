"""`eagle3-hf check`: lint a drafter checkpoint for the failures that serve silently at τ ≈ 1.

Reads `config.json` and the safetensors headers (tensor values only for the few checks that need them);
it never builds a model. This module reads the checkpoint (local or on the Hub) and reports; the rules,
and the engine behaviour each guards against, are in `eagle3_hf/publish/rules.py`, `attention_rules.py` and
`llamacpp_rules.py` (llama.cpp's converter and loader) for an EAGLE-3 drafter, in `dflash_rules.py` for a DFlash
one (the kind its config.json's `architectures` declare, `eagle3_hf/engines/table.py`); the findings in `report.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..engines.table import checkpoint_engines, drafter_kind, engine_row
from ..errors import UsageError, json_object
from ..verifier.family import text_config
from .aux_id_rules import sglang_family
from .llamacpp_graphs import check_llamacpp_verifier
from .llamacpp_rope import check_llamacpp_rope
from .mode_rules import check_thinking_mode
from .report import ENGINES, LEVELS, Finding, Report
from .rope_rules import check_rope
from .rules import (
    CheckpointWeights,
    check_config,
    check_names_and_shapes,
    check_values,
    check_verifier,
    check_vocab_mapping,
)

__all__ = ["Finding", "check_drafter"]


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    return sorted(root.glob("*.safetensors"))


def resolve_checkpoint(path_or_repo: str | os.PathLike, revision: str | None, patterns: list[str]) -> Path:
    """A local directory as is; anything else is a Hub repo id, downloaded (only `patterns`)."""
    path = Path(path_or_repo)
    if path.is_dir():
        return path
    if path.exists() or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", str(path_or_repo)):
        raise FileNotFoundError(f"{path_or_repo} is neither a checkpoint directory nor a Hub repo id")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_repo), revision=revision, allow_patterns=patterns))


def _load_verifier(verifier: str, revision: str | None = None) -> tuple[dict, Path | None, list[str]]:
    """(text config, local directory or None, the top-level `architectures` SGLang picks its model file by)."""
    from ..verifier.loading import resolve_verifier

    path: Path | None = Path(resolve_verifier(verifier))  # the embedded default's name -> its cached directory
    if path is not None and path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
    else:
        from huggingface_hub import hf_hub_download

        cfg = json.loads(Path(hf_hub_download(verifier, "config.json", revision=revision)).read_text())
        path = None
    return text_config(cfg), path, list(cfg.get("architectures") or [])


def _verifier_embedding(root: Path) -> tuple[Any, str] | None:
    """(weights, name) of the verifier's input embedding in a local checkpoint, if findable."""
    files = _weight_files(root)
    if not files:
        return None
    weights = CheckpointWeights(files)
    names = [n for n in weights.meta if n.endswith("embed_tokens.weight")]
    return (weights, sorted(names, key=len)[0]) if names else None


def check_drafter(
    path_or_repo: str | os.PathLike,
    verifier: str | None = None,
    engine: str | Iterable[str] = "all",
    revision: str | None = None,
    engine_versions: dict[str, str | None] | None = None,
    served_kwargs: dict[str, Any] | None = None,
) -> list[Finding]:
    """Every reason this checkpoint would serve badly in the engines asked about (SGLang, vLLM, llama.cpp; "all" or
    one name or several), errors first: the rules of the kind config.json's architectures declare (its row in
    engines/table.py names them: `check_eagle3`, `check_dflash` below). `engine_versions`:
    the release of each engine to check the version-dependent rules against (none: every release read);
    `served_kwargs`: the chat-template kwargs the server renders with (the thinking mode; None: unknown)."""
    rep = Report(engine)
    try:
        root = resolve_checkpoint(path_or_repo, revision, ["*.json", "*.safetensors"])
    except Exception as exc:  # noqa: BLE001 - a missing path or failed download is a finding, not a crash
        detail = str(exc) if isinstance(exc, FileNotFoundError) else (
            f"not a directory here, and fetching it as a Hub repo id failed: {type(exc).__name__}: {exc}")
        return [Finding("error", "not-found", f"{path_or_repo}: {detail}")]
    try:
        cfg = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        return [Finding("error", "missing-config", f"no config.json in {path_or_repo}")]
    except json.JSONDecodeError as exc:
        return [Finding("error", "bad-config", f"config.json in {path_or_repo} is not valid JSON: {exc}")]
    checks = drafter_kind(cfg).checks_function()  # the kind's row (engines/table.py) names its rules
    checks(root, cfg, rep, verifier, str(path_or_repo), served_kwargs, engine_versions or {})
    return sorted(rep.findings, key=lambda f: LEVELS.index(f.level))


def check_eagle3(root: Path, cfg: dict, rep: Report, verifier: str | None, name: str,
                 served_kwargs: dict[str, Any] | None, engine_versions: dict[str, str | None]) -> None:
    """An EAGLE-3 drafter's findings into `rep` (rules.py and the rule modules it names)."""
    if cfg.get("speculators_model_type") or "Eagle3Speculator" in (cfg.get("architectures") or []):
        rep.add("error", "speculators-layout", "speculators layout (Eagle3Speculator): SGLang cannot load it "
                "(it drops layers.0.* silently); export the standard layout", ("sglang",))
        layer = dict(cfg.get("transformer_layer_config") or {})
        nbr = cfg.get("norm_before_residual")
        if nbr is None:
            rep.add("warning", "norm-before-residual", "speculators layout without norm_before_residual: vLLM defaults "
                    "it to true; eagle3_hf drafters are trained with false", ("vllm",))
        cfg = {**layer, **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")},
               "architectures": ["LlamaForCausalLMEagle3"], "model_type": layer.get("model_type", "llama")}
        rep.engines.discard("sglang")  # the remaining checks are about what vLLM makes of it
    vcfg, vpath, varch = None, None, list(cfg.get("verifier_architectures") or [])  # as export records them
    if verifier is not None:
        try:
            vcfg, vpath, varch = _load_verifier(verifier)
        except Exception as exc:  # noqa: BLE001
            rep.add("error", "verifier-not-found", f"cannot read the verifier config from {verifier}: {exc}")
    num_layers = (vcfg or {}).get("num_hidden_layers") or cfg.get("verifier_num_hidden_layers")
    check_config(cfg, rep, int(num_layers) if num_layers else None, sglang_family(varch))
    check_llamacpp_verifier(varch, rep)
    check_rope(cfg, rep, engine_versions)
    check_llamacpp_rope(cfg, rep)
    check_thinking_mode(cfg, rep, served_kwargs)
    w = _read_weights(root, name, rep)
    if w is not None:
        check_names_and_shapes(cfg, w, rep)
        check_values(cfg, w, rep)
        check_vocab_mapping(cfg, w, rep, (vcfg or {}).get("vocab_size"))
        if vcfg is not None:
            check_verifier(cfg, w, rep, vcfg, (lambda: _verifier_embedding(vpath)) if vpath else None)


def check_dflash(root: Path, cfg: dict, rep: Report, verifier: str | None, name: str,
                 served_kwargs: dict[str, Any] | None, engine_versions: dict[str, str | None]) -> None:
    """A DFlash drafter's findings into `rep` (publish/dflash_rules.py); what does not depend on the drafter's kind
    applies as to EAGLE-3: llama.cpp's verifier graphs (its DFlash reads the same captured layer inputs) and the
    thinking mode."""
    from .dflash_rules import check_dflash_config, check_dflash_weights

    vcfg, varch = None, list(cfg.get("verifier_architectures") or [])
    if verifier is not None:
        try:
            vcfg, _, varch = _load_verifier(verifier)
        except Exception as exc:  # noqa: BLE001
            rep.add("error", "verifier-not-found", f"cannot read the verifier config from {verifier}: {exc}")
    ids = check_dflash_config(cfg, rep, vcfg)
    check_llamacpp_verifier(varch, rep)
    check_thinking_mode(cfg, rep, served_kwargs)
    weights = _read_weights(root, name, rep)
    if weights is not None:
        check_dflash_weights(cfg, weights, rep, ids)


def _read_weights(root: Path, name: str, rep: Report) -> CheckpointWeights | None:
    """The checkpoint's safetensors, or None with the finding that says why not (none, or unreadable), for either
    kind's weight rules."""
    files = _weight_files(root)
    if not files:
        extra = " (pickle checkpoints are not read; save with safetensors)" if list(root.glob("*.bin")) else ""
        rep.add("error", "missing-weights-file", f"no *.safetensors in {name}{extra}")
        return None
    try:
        return CheckpointWeights(files)
    except Exception as exc:  # noqa: BLE001 - truncated / corrupt file
        rep.add("error", "bad-weights-file", f"cannot read safetensors in {name}: {exc}")
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("drafter", help="checkpoint directory or Hub repo id")
    parser.add_argument("--verifier", default=None, help="verifier directory or Hub repo id (sizes, layers, "
                        "embedding, and the SGLang aux-id reader of its family)")
    servers = " and ".join(engine_row(name).label for name in checkpoint_engines())
    by_name = ", ".join(name for name in ENGINES if name not in checkpoint_engines())
    parser.add_argument("--engine", choices=("all",) + ENGINES, default="all",
                        help=f"serving engine to check for (all: {servers}, which load this layout by repo "
                             f"id; {by_name}, by name only: llama.cpp's GGUF converter and EAGLE-3 loader)")
    parser.add_argument("--engine-version", default=None, metavar="VERSION", help="the --engine release to check "
                        "against (e.g. 0.32.0 for vLLM, 0.5.23 for SGLang); default: the installed one (vLLM: the "
                        "`make vllm` venv, else this environment's; SGLang: this environment's), else every release "
                        "read, whose differences are warnings")
    parser.add_argument("--revision", default=None, help="Hub revision of the drafter")
    parser.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                        help="the chat-template kwargs the server renders with (its --default-chat-template-kwargs, "
                             "e.g. '{\"thinking\": true}'): an error where they set the thinking mode otherwise than "
                             "the drafter was trained in")
    parser.add_argument("--json", action="store_true", help="print findings as JSON")

def installed_version(engine: str) -> tuple[str, str] | None:
    """(version, where) of the engine installed here: vLLM in the `make vllm` venv (its stamp records the pin),
    else either engine in this environment; None when neither has it."""
    import importlib.metadata

    if engine == "vllm":
        from ..engines.vllm.vllm_env import STAMP, vllm_venv

        stamp = vllm_venv() / STAMP
        pin = re.search(r"==(\S+)", stamp.read_text()) if stamp.is_file() else None
        if pin:
            return pin.group(1), str(vllm_venv())
    try:
        return importlib.metadata.version(engine), "this environment"
    except importlib.metadata.PackageNotFoundError:
        return None


def engine_versions(engine: str, version: str | None) -> dict[str, str | None]:
    """The release of each engine `check` judges against: `--engine-version` for the one `--engine`, else what is
    installed. UsageError for a version without one engine to apply it to."""
    if version is not None:
        if engine not in ENGINES:
            raise UsageError(f"--engine-version {version} needs one engine: pass --engine "
                             f"{' or --engine '.join(ENGINES)}")
        return {engine: version}
    found = {e: installed_version(e) for e in ENGINES if engine in ("all", e)}
    return {e: v[0] for e, v in found.items() if v}


def findings_of(args: argparse.Namespace) -> tuple[list[Finding], dict[str, str | None]]:
    """The static findings of `check`'s arguments, and the engine releases they were judged against."""
    versions = engine_versions(args.engine, args.engine_version)
    return check_drafter(args.drafter, verifier=args.verifier, engine=args.engine, revision=args.revision,
                         engine_versions=versions, served_kwargs=args.chat_template_kwargs), versions


def report(findings: list[Finding], args: argparse.Namespace, versions: dict[str, str | None],
           instead_of_ok: str | None = None) -> int:
    """Print the findings (or their JSON) and the verdict line (`instead_of_ok`, when given, replaces an OK line: the
    live check's "not enough evidence"); the exit status: 1 with any error."""
    errors = sum(f.level == "error" for f in findings)
    if args.json:
        print(json.dumps([f.__dict__ for f in findings], indent=2))
    else:
        for f in findings:
            print(f)
        warnings = sum(f.level == "warning" for f in findings)
        verdict = "FAILED" if errors else "OK"
        against = "".join(f", {e} {v}" for e, v in sorted(versions.items()))
        summary = f"{errors} error(s), {warnings} warning(s) for {args.engine}{against} ({args.drafter})"
        print(f"{instead_of_ok}; {summary}" if instead_of_ok and not errors else f"{verdict}: {summary}")
    return 1 if errors else 0


def run(args: argparse.Namespace) -> int:
    """The static lint alone (`eagle3-hf check` adds the live check: evaluation/check_command.py)."""
    findings, versions = findings_of(args)
    return report(findings, args, versions)
