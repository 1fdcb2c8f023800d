"""The engines' aux-layer-id readers, and `check`'s rules on a config's aux-layer ids.

A drafter is trained on three transformers `output_hidden_states` indices (the residual stream entering layer i).
Each engine turns a config's ids into captured indices its own way, and SGLang's way depends on the verifier:
its reader is the target model's `set_eagle3_layers_to_capture`, one per model file, and the files disagree.
`AUX_ID_READERS` holds every rule read, per engine, SGLang target family and release; docs/contracts.md has the
table with the file and releases each was read from. `check` runs the readers of the verifier's family (every
family's where it is unknown) and reports ids some reader would capture as other layers than the top-level ids
name; `sglang_ids_to_send` inverts the readers for extraction through a SGLang server.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..verifier.family import aux_indices_problem
from .report import ENGINES, SERVERS, Report

Ids = list[int] | None
Read = Callable[[Ids, Ids, int | None], list[int] | str]


@dataclass(frozen=True)
class AuxIdReader:
    """How one engine release range turns a config's aux-layer ids into the verifier layers it captures.

    `read(top, nested, n)` gets the top-level `eagle_aux_hidden_state_layer_ids`, `eagle_config`'s (the ids
    SGLang is sent), and the verifier's depth (None where unknown) and returns the captured `output_hidden_states`
    indices, or "default" for the default (2, N//2, N-3) of an unknown depth. `family` is the SGLang target family
    (`SGLANG_FAMILIES`), "any" for vLLM, whose reader is one for every target. `releases` is the first and last
    release this rule was read in (None: known only from the PR); `source` the file it was read from."""

    engine: str
    family: str
    version: str
    source: str
    read: Read
    releases: tuple[tuple[int, ...], tuple[int, ...]] | None = None


def default_capture(n: int | None) -> list[int] | str:
    """Every reader's capture without ids: (2, N//2, N-3), as given (no + 1)."""
    return [2, n // 2, n - 3] if n else "default"


def _plus_one(top: Ids, nested: Ids, n: int | None) -> list[int] | str:
    return [i + 1 for i in nested] if nested else default_capture(n)


def _pr_25454(top: Ids, nested: Ids, n: int | None) -> list[int] | str:
    if not nested:
        return default_capture(n)
    return [i + 1 for i in nested] if nested[0] == 1 else list(nested)


def _gpt_oss(top: Ids, nested: Ids, n: int | None) -> list[int] | str:
    if not nested:
        return default_capture(n)
    return list(nested) if n is not None and max(nested) == n else [i + 1 for i in nested]


# SGLang's ids come from eagle_config only (model_executor/model_runner.py in 0.5.10-0.5.15,
# model_runner_components/spec_aux_hidden_state.py in 0.5.18-0.5.23); none -> the model file's default
AUX_ID_READERS = (
    AuxIdReader("sglang", "llama", "0.5.10-0.5.23", "python/sglang/srt/models/llama.py set_eagle3_layers_to_capture "
                "(the same in qwen2.py, qwen3.py, qwen3_moe.py, glm4_moe.py, gemma3_causal.py): each id + 1",
                _plus_one, ((0, 5, 10), (0, 5, 23))),
    AuxIdReader("sglang", "deepseek", "0.5.10-0.5.12 (before PR 25454)", "python/sglang/srt/models/deepseek_v2.py "
                "set_eagle3_layers_to_capture: each id + 1", _plus_one, ((0, 5, 10), (0, 5, 12))),
    AuxIdReader("sglang", "deepseek", "0.5.13-0.5.23 (PR 25454)", "python/sglang/srt/models/deepseek_v2.py and "
                "glm4_moe_lite.py set_eagle3_layers_to_capture: + 1 only when the first id is 1, else as they are",
                _pr_25454, ((0, 5, 13), (0, 5, 23))),
    AuxIdReader("sglang", "gpt_oss", "0.5.10-0.5.15", "python/sglang/srt/models/gpt_oss.py "
                "set_eagle3_layers_to_capture: each id + 1", _plus_one, ((0, 5, 10), (0, 5, 15))),
    AuxIdReader("sglang", "gpt_oss", "0.5.18-0.5.23", "python/sglang/srt/models/gpt_oss.py "
                "set_eagle3_layers_to_capture: as they are when the largest is N, else each + 1",
                _gpt_oss, ((0, 5, 18), (0, 5, 23))),
    AuxIdReader("vllm", "any", "before PR 42764", "vllm/v1/worker/gpu_model_runner.py "
                "(_get_eagle3_aux_layers_from_config): only the top-level ids, as they are",
                lambda top, nested, n: list(top) if top else default_capture(n)),
    AuxIdReader("vllm", "any", "since PR 42764 (May 2026; 0.32.0 read here)", "vllm/v1/worker/gpu_model_runner.py "
                "(_get_eagle3_aux_layers_from_config): the top-level ids, else eagle_config's, both as they are",
                lambda top, nested, n: list(top) if top else (list(nested) if nested else default_capture(n))),
)

# SGLang resolves a verifier's `architectures` to a model file (its `EntryClass`); 0.5.23's files, with the
# classes that inherit their reader (Kimi-K2.5 wraps DeepseekV3ForCausalLM; GlmMoeDsa and MistralLarge3 subclass it)
SGLANG_FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "InternLM3ForCausalLM",
              "IQuestCoderForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
              "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    "deepseek": ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM",
                 "KimiK25ForConditionalGeneration", "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM",
                 "MistralLarge3ForCausalLM"),
    "gpt_oss": ("GptOssForCausalLM",),
}


def sglang_family(architectures: Sequence[str] | None) -> str | None:
    """The SGLang reader family of a verifier's `architectures` (its first listed one), None when not in the table."""
    for arch in architectures or ():
        for family, names in SGLANG_FAMILIES.items():
            if arch in names:
                return family
    return None


def _version_tuple(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in version.split("+")[0].split(".")[:3])
    except ValueError:
        raise UsageError(f"SGLang version {version!r} is not of the form X.Y.Z") from None


def sglang_readers(family: str | None, version: str | None = None) -> list[AuxIdReader]:
    """SGLang's readers for a family (every family's when None), narrowed to a release when one is given and was
    read; a release outside those read keeps them all, so it must agree with every one."""
    if family is not None and family not in SGLANG_FAMILIES:
        raise UsageError(f"unknown SGLang family {family!r}; known: {', '.join(SGLANG_FAMILIES)}")
    mine = [r for r in AUX_ID_READERS if r.engine == "sglang" and family in (None, r.family)]
    if version is not None:
        v = _version_tuple(version)
        released = [r for r in mine if r.releases and r.releases[0] <= v <= r.releases[1]]
        mine = released or mine
    return mine


def _encodings(want: list[int]) -> tuple[list[int], list[int]]:
    """The two forms a reader can take ids in: each index - 1 (a layer's output) and the index itself."""
    return [i - 1 for i in want], list(want)


def _ids_for(reader: AuxIdReader, want: list[int], n: int | None) -> list[int] | None:
    return next((ids for ids in _encodings(want) if reader.read(None, ids, n) == want), None)


def sglang_ids_to_send(indices: Sequence[int], family: str | None, num_layers: int | None = None,
                       version: str | None = None) -> list[int]:
    """The ids to give SGLang (`eagle_config.eagle_aux_hidden_state_layer_ids`, or the server's
    `return_aux_hidden_state_layer_ids`) so that it captures `output_hidden_states` indices `indices` with every
    reader of `family` (every family when None; one release when `version` is given). Llama: each index - 1;
    DeepSeek-V3 / Kimi since PR 25454: the same when the first index is 2, else the indices as they are. Raises
    UsageError when no ids are read back as `indices` by all of them."""
    want = [int(i) for i in indices]
    readers = sglang_readers(family, version)
    for ids in _encodings(want):
        if all(r.read(None, ids, num_layers) == want for r in readers):
            return ids
    said = "; ".join(f"{r.family} {r.version} reads [i - 1] as {r.read(None, [i - 1 for i in want], num_layers)}, "
                     f"{want} as {r.read(None, want, num_layers)}" for r in readers)
    raise UsageError(f"no SGLang aux-layer ids capture indices {want} for the {family or 'unknown'} family"
                     f"{f' in SGLang {version}' if version else ''}: {said}")


def aux_ids_of(cfg: dict) -> tuple[Ids, Ids]:
    """(top-level ids, eagle_config's ids) of a config.json, each None when absent or empty."""
    top = [int(i) for i in cfg.get("eagle_aux_hidden_state_layer_ids") or []] or None
    eagle = cfg.get("eagle_config")
    nested = [int(i) for i in (eagle.get("eagle_aux_hidden_state_layer_ids") or [])] if isinstance(eagle, dict) else []
    return top, nested or None


def aux_ids_read(cfg: dict, num_layers: int | None,
                 family: str | None = None) -> list[tuple[AuxIdReader, list[int] | str]]:
    """What the vLLM readers and SGLang's readers of `family` (every family's when None) capture for this config."""
    top, nested = aux_ids_of(cfg)
    readers = [r for r in AUX_ID_READERS if r.engine == "vllm"] + sglang_readers(family)
    return [(reader, reader.read(top, nested, num_layers)) for reader in readers]


def _send_hint(indices: list[int], family: str | None, n: int | None) -> str:
    """What to write in eagle_config so that SGLang captures `indices`, or why nothing can be."""
    try:
        return f"write eagle_config {sglang_ids_to_send(indices, family, n)}"
    except UsageError:
        per = "; ".join(f"{r.family} {r.version}: {_ids_for(r, indices, n) or 'none'}" for r in sglang_readers(family))
        return (f"no eagle_config ids are read as {indices} by every {family or 'SGLang'} release read ({per}): "
                "train on the default indices (2, N//2, N-3) or pin the SGLang release")


def check_aux_id_versions(cfg: dict, rep: Report, n: int | None, family: str | None = None) -> None:
    """An error where the readers that apply capture different layers from one another: vLLM's releases, and
    SGLang's releases of the verifier's family (or, family unknown, of every family). No export is right for all
    of them, so the drafter serves on layers it was not trained on somewhere, silently."""
    readings = aux_ids_read(cfg, n, family)
    for engine in ("sglang", "vllm"):
        mine = [(reader, got) for reader, got in readings if reader.engine == engine]
        if len({str(got) for _, got in mine}) < 2:
            continue
        if engine == "sglang" and family is None:
            said = "; ".join(f"{r.family} {r.version} captures {got}" for r, got in mine)
            rep.add("error", "aux-ids-sglang-families", f"SGLang reads these aux ids per verifier family, and the "
                    f"families read them as different layers: {said} (docs/contracts.md). Pass --verifier to check "
                    "for its family, or train on the default indices (2, N//2, N-3), which every reader reads alike",
                    ("sglang",))
            continue
        who = f"SGLang's {family}-family" if engine == "sglang" else "vLLM"
        said = "; ".join(f"{r.version} captures {got} ({r.source})" for r, got in mine)
        rep.add("error", f"aux-ids-{engine}-versions", f"{who} releases read these aux ids as different layers: "
                f"{said}. Train on the default indices (2, N//2, N-3), which every release reads alike, or pin the "
                "engine release", (engine,))


def check_aux_ids(cfg: dict, rep: Report, n: int | None, family: str | None = None) -> None:
    """The aux-id rules: each engine finds ids where it reads them, SGLang's readers (of `family`, or of every
    family when unknown) capture what the top-level ids name, and the ids are in range."""
    top, nested = aux_ids_of(cfg)
    eagle = cfg.get("eagle_config")
    default = default_capture(n)
    default_txt = str(default) if n else "(2, N//2, N-3) for an N-layer verifier"
    sglang = {str(got): got for r, got in aux_ids_read(cfg, n, family) if r.engine == "sglang"}
    agreed = next(iter(sglang.values())) if len(sglang) == 1 else None  # what SGLang captures, if its readers agree
    reader = f"SGLang's {family} reader" if family else "SGLang (every family's reader)"
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state") is False:
        rep.add("error", "use-aux-hidden-state", "eagle_config.use_aux_hidden_state is false: SGLang and vLLM then "
                "skip fc and feed a single hidden state (EAGLE-1 style)", SERVERS)
    if top and nested:
        if top not in sglang.values():  # no reader captures what vLLM does (readers that disagree: *-versions too)
            hint = " (the same numbers in both: off by one for one engine)" if top == nested else ""
            rep.add("error", "aux-ids-mismatch", f"vLLM reads top-level eagle_aux_hidden_state_layer_ids {top} as "
                    f"hidden-state indices, {reader} reads eagle_config's {nested} as "
                    f"{' or '.join(map(str, sglang.values()))}: the engines feed different layers{hint}; for "
                    f"training indices {top}, {_send_hint(top, family, n)}", SERVERS)
    elif nested and not top:
        used = agreed if isinstance(agreed, list) else [i + 1 for i in nested]
        level = "warning" if not n else ("error" if used != default else "info")
        rep.add(level, "aux-ids-vllm", f"no top-level eagle_aux_hidden_state_layer_ids: vLLM before PR 42764 ignores "
                f"eagle_config and captures its default {default_txt}, vLLM since then reads eagle_config's "
                f"{nested} as they are; {reader} captures {used}; add top-level {used}", ("vllm",))
    elif top and not nested:
        level = "warning" if not n else ("error" if top != default else "info")
        rep.add(level, "aux-ids-sglang", f"no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang reads only that "
                f"key and falls back to capturing {default_txt}, vLLM captures {top}; with use_aux_hidden_state "
                f"true, {_send_hint(top, family, n)}", ("sglang",))
    else:
        rep.add("warning", "aux-ids-missing", f"no aux layer ids at all: both engines capture {default_txt}; right "
                "only if the drafter was trained on exactly those hidden-state indices", SERVERS)
    ids = top or (agreed if isinstance(agreed, list) else [i + 1 for i in nested] if nested else [])
    problem = aux_indices_problem(ids, n) if ids else None  # the rule extraction and training apply
    if problem:
        kind, why = problem
        why += " (EAGLE-3's fc reads three layers: 3 x target_hidden_size)" if kind == "count" else ""
        # llama.cpp's own count rule names its loader (llamacpp_rules.py)
        rep.add("error", f"aux-ids-{kind}", f"the config's aux hidden-state ids: {why}",
                SERVERS if kind == "count" else ENGINES)
    check_aux_id_versions(cfg, rep, n, family)
