"""`eagle3-hf plan`'s inputs: the files the run itself uses (the recipe, the accelerate config and the DeepSpeed
file it names, the verifier's config, an extracted feature directory), read into what the plan computes from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from .plan_reader import READER_GBPS

if TYPE_CHECKING:
    from ..verifier.footprint import Footprint

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Launch:
    """How the run is launched: what the accelerate config (and the DeepSpeed file it names) say."""

    num_processes: int = 1
    num_machines: int = 1
    zero_stage: int = 0  # 0: no DeepSpeed
    offload_optimizer: bool = False
    offload_param: bool = False
    zero_init: bool = False
    deepspeed_file: str | None = None


@dataclass(frozen=True)
class Hardware:
    """What the plan assumes of the machines: a GPU's memory and bf16 peak, the share of it the run reaches, and the
    rate one node's feature disk sustains."""

    gpu_memory_gib: float = 80.0
    reserve_gib: float = 2.0  # kept back for the CUDA context, NCCL
    mfu: float = 0.35
    peak_tflops: float = 989.0
    disk_gbps: float = 2.0


@dataclass(frozen=True)
class ExtractionInputs:
    """How the features are extracted: every node's GPUs (default 8 per machine of the launch), the GPUs one engine
    spans (default: derived from the verifier's weights), an assumed prefill rate (default: from the FLOPs), one
    reader thread's GB/s and the verifier's weights as the engines load them (default: its text config in bf16)."""

    gpus: int | None = None
    gpus_per_engine: int | None = None
    tokens_per_s: float | None = None
    reader_gbps: float = READER_GBPS
    verifier_weights: Footprint | None = None


def load_yaml_or_json(path: str | Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            loaded: dict[str, Any] = yaml.safe_load(f) or {}
        else:
            loaded = json.load(f)
    return loaded


def _find(path: str, near: Path) -> Path:
    """A path as written in a config: relative to the working directory, else to the repository."""
    for candidate in (Path(path), near / path, REPO / path):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{path}: not found (looked in the working directory, {near} and {REPO})")


def read_launch(accelerate_config: str | None, recipe: dict[str, Any]) -> Launch:
    """Processes and machines from the accelerate config; ZeRO stage and offload from its DeepSpeed file
    (or the recipe's `deepspeed` key)."""
    acc = load_yaml_or_json(accelerate_config) if accelerate_config else {}
    launch = Launch(num_processes=int(acc.get("num_processes", 1)), num_machines=int(acc.get("num_machines", 1)))
    ds = acc.get("deepspeed_config") or {}
    ds_file = ds.get("deepspeed_config_file") or recipe.get("deepspeed")
    if ds_file:
        path = _find(ds_file, Path(accelerate_config).parent if accelerate_config else REPO)
        zero = load_yaml_or_json(path).get("zero_optimization", {})
        launch.zero_stage = int(zero.get("stage", 0))
        launch.offload_optimizer = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
        launch.offload_param = (zero.get("offload_param") or {}).get("device", "none") not in ("none", None)
        launch.zero_init = bool(ds.get("zero3_init_flag", False))
        launch.deepspeed_file = str(ds_file)
    return launch


def verifier_text_config(recipe: dict[str, Any], verifier_config: str | None) -> dict[str, Any]:
    """The verifier's language-model config: from `--verifier-config`, else the recipe's verifier
    (a local directory or a cached Hub id)."""
    from ..verifier.family import text_config_dict

    if verifier_config:
        return text_config_dict(load_yaml_or_json(verifier_config))
    name = recipe.get("verifier")
    if not name:
        raise UsageError("the recipe names no verifier: pass --verifier-config FILE")
    try:
        from ..verifier.loading import load_config, resolve_verifier

        return text_config_dict(load_config(resolve_verifier(name)))
    except Exception as err:  # noqa: BLE001 - offline, gated, remote code: all need the same hint
        raise UsageError(f"cannot read the config of verifier {name!r} ({type(err).__name__}); pass "
                         f"--verifier-config FILE (e.g. examples/recipes/kimi_k25_text_config.json)") from err


def dataset_from_features(recipe: dict[str, Any]) -> tuple[float, float] | None:
    """(tokens, mean sample length) of the recipe's `features` directory when its features are already extracted."""
    from ..features.store import load_manifest

    data_dir = recipe.get("features")
    if not data_dir or not (Path(data_dir) / "manifest.json").is_file():
        return None
    lengths = [int(s["length"]) for s in load_manifest(data_dir, allow_partial=True)["samples"]]  # an estimate
    return (float(sum(lengths)), sum(lengths) / len(lengths)) if lengths else None


def draft_vocab_from_features(recipe: dict[str, Any]) -> int | None:
    """The draft vocabulary size of the recipe's `features/vocab.safetensors` (what training will use)."""
    from safetensors import safe_open

    path = Path(recipe.get("vocab") or Path(recipe.get("features") or "/nonexistent") / "vocab.safetensors")
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return int(f.get_slice("d2t").get_shape()[0])


def verifier_weights(recipe: dict[str, Any], verifier_config: str | None, dtype: str,
                     text_cfg: dict[str, Any]) -> Footprint:
    """The verifier's weights as an engine loads them (verifier/footprint.py): `--verifier-config`'s file, else the
    recipe's verifier's config.json and safetensors index (never a weight), else its text config. `dtype` auto: the
    checkpoint's, bf16 where that is fp32 (vLLM serves an fp32 checkpoint in 16 bits)."""
    from ..verifier.footprint import checkpoint_footprint, config_dtype, footprint

    def chosen(config: dict[str, Any]) -> str:
        if dtype != "auto":
            return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
        return "bfloat16" if config_dtype(config) == "float32" else config_dtype(config)

    if verifier_config:
        config = load_yaml_or_json(verifier_config)
        return footprint(config, chosen(config))
    try:
        from ..verifier.checkpoint_files import CheckpointFiles

        config = CheckpointFiles(str(recipe["verifier"])).config()
        return checkpoint_footprint(str(recipe["verifier"]), chosen(config))
    except Exception:  # noqa: BLE001 - offline or gated: the text config's sizes still give the weights
        return footprint(text_cfg, chosen(text_cfg))
