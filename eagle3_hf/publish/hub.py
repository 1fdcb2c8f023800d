"""Publish a drafter: check it, write its model card, upload the standard layout; `eagle3-hf push`.

Failures that would otherwise surface as a bare HTTP status (bad token, no write access, an existing
branch, no network) become `HubError`s that say what to do. Tokens never reach a log line or an exception
message: every message is scrubbed, and the original exception is not chained (its request objects
carry the Authorization header).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..constants import EVALUATION_FILE, TRAINING_FILE
from ..errors import Eagle3Error
from .check import Finding, check_drafter
from .model_card import write_model_card
from .report import SERVERS
from .serving import DEFAULT_GPU_GIB, DEFAULT_PUSH_DTYPE, PUSH_DTYPES, stage_in_dtype, verifier_serving

logger = logging.getLogger(__name__)

# what a drafter repo holds; Trainer leftovers (optimizer.pt, rng_state_*.pth, trainer_state.json) stay local
ALLOW_PATTERNS = ["*.safetensors", "*.json", "README.md", "*.gguf"]  # a GGUF only when push --gguf staged one
IGNORE_PATTERNS = ["trainer_state.json", "training_args*", "checkpoint-*/**", ".*"]
_TOKEN_LIKE = re.compile(r"\bhf_[A-Za-z0-9]{8,}\b")  # a user access token, whoever's it is


class HubError(Eagle3Error, RuntimeError):
    """A Hub request failed (auth, permission, conflict, network); the message says what to do. An `Eagle3Error`, so
    every command reports it as one line; still a RuntimeError for callers that caught it as one."""


class DrafterCheckError(ValueError):
    """`check_drafter` found errors: the checkpoint would not serve correctly, so it is not pushed."""

    def __init__(self, findings: list[Finding]):
        self.findings = findings
        lines = "\n".join(f"  {f}" for f in findings if f.level == "error")
        super().__init__(f"refusing to push: the checkpoint fails `eagle3-hf check`:\n{lines}\n"
                         "fix these (or pass run_check=False / --no-check to push anyway)")


def _scrub(text: str, token: str | None) -> str:
    if token:
        text = text.replace(token, "***")
    return _TOKEN_LIKE.sub("***", text)


def _is_network_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return isinstance(exc, (ConnectionError, TimeoutError)) or module.split(".")[0] in ("httpx", "httpx2", "httpcore",
                                                                                      "requests", "urllib3")


@contextlib.contextmanager
def hub_errors(action: str, repo_id: str, token: str | None = None) -> Iterator[None]:
    """Translate huggingface_hub / transport exceptions raised inside into a token-free `HubError`."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    try:
        yield
    except OfflineModeIsEnabled:
        raise HubError(f"cannot {action} {repo_id}: offline mode is on (HF_HUB_OFFLINE=1); unset it") from None
    except RevisionNotFoundError as exc:
        raise HubError(f"cannot {action} {repo_id}: branch or revision not found "
                       f"({_scrub(str(exc).splitlines()[-1], token)})") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        server = _scrub(" ".join(str(exc).split()), token)
        if status == 401:
            msg = (f"authentication failed at {endpoint}: the token is invalid or expired. Set HF_TOKEN or run "
                   "`hf auth login` with a token that has write access")
        elif status == 403:
            msg = (f"no write access to {repo_id} at {endpoint}: use a token with the 'write' role for that "
                   "user or organization")
        elif status in (409, 412):
            msg = f"conflict at {endpoint}: {server} (someone else changed the repo or the name exists); retry"
        elif isinstance(exc, RepositoryNotFoundError):
            msg = f"repository {repo_id} not found at {endpoint}, or the token cannot see it"
        else:
            msg = f"the Hub at {endpoint} answered {status}: {server}"
        raise HubError(f"cannot {action} {repo_id}: {msg}") from None
    except Exception as exc:
        if not _is_network_error(exc):
            raise
        raise HubError(f"cannot {action} {repo_id}: network failure reaching {endpoint} "
                       f"({type(exc).__name__}: {_scrub(str(exc), token)}); check the connection, proxy "
                       "and HF_ENDPOINT") from None


def _stage_model(model: Any, directory: Path) -> Path:
    """save_pretrained into `directory`, with the training/evaluation records of the dir it came from."""
    model.save_pretrained(directory)
    source = Path(str(getattr(model, "name_or_path", "") or ""))
    for name in (TRAINING_FILE, EVALUATION_FILE):
        if source.is_dir() and (source / name).is_file() and not (directory / name).exists():
            shutil.copy2(source / name, directory / name)
    return directory


def _stage_with(folder: Path, extra: Path, stage: Path) -> Path:
    """`folder`'s files and `extra` side by side in `stage`, as links (only the card is copied: it is rewritten
    there, never through a link into the user's folder)."""
    if not extra.is_file():
        raise FileNotFoundError(f"--gguf {extra}: no such file (write it with `eagle3-hf export --format gguf`)")
    stage.mkdir(parents=True)
    for file in folder.iterdir():
        if file.name == "README.md":
            shutil.copy2(file, stage / file.name)
        elif file.is_file():
            (stage / file.name).symlink_to(file.resolve())
    (stage / extra.name).symlink_to(extra.resolve())
    return stage


def _recorded_verifier(folder: Path) -> str | None:
    """The verifier recorded with the checkpoint (its training record, else its config)."""
    name = None
    for file, key in ((TRAINING_FILE, "verifier"), ("config.json", "verifier_name_or_path")):
        try:
            name = name or json.loads((folder / file).read_text()).get(key)
        except (OSError, json.JSONDecodeError):
            continue
    return str(name) if name else None


def _local_verifier(folder: Path) -> str | None:
    """The verifier recorded with the checkpoint, when it is a local directory (checked without network)."""
    name = _recorded_verifier(folder)
    return name if name and Path(name).is_dir() else None


def push_drafter(
    model_or_dir: Any,
    repo_id: str,
    token: str | bool | None = None,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    run_check: bool = True,
    commit_description: str | None = None,
    create_pr: bool = False,
    tags: list[str] | None = None,
    dtype: str = DEFAULT_PUSH_DTYPE,
    tensor_parallel: int | None = None,
    gpu_memory_gib: float = DEFAULT_GPU_GIB,
    gguf: str | os.PathLike | None = None,
) -> str:
    """Check, card and upload a drafter (a model with `save_pretrained` or a checkpoint directory).

    Returns the commit URL (a `CommitInfo`, which is a str). `revision` names a branch, created from main when
    missing. `tags` are added to the card's own. The floating weights are uploaded in `dtype` (bf16, fp16, fp32;
    d2t and t2d as stored); the serve commands carry the verifier's tensor-parallel size (`tensor_parallel`, else
    derived for GPUs of `gpu_memory_gib`) and its remote code (publish/serving.py). `gguf`: the drafter's
    llama.cpp file (`eagle3-hf export --format gguf`), uploaded beside the standard layout, and llama.cpp's rules
    checked too. Raises `DrafterCheckError` when
    the checkpoint would not serve, `HubError` for auth / network / conflicts.
    """
    from huggingface_hub import HfApi, get_token

    if dtype not in PUSH_DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(PUSH_DTYPES)}")
    token = token if isinstance(token, str) and token else get_token()  # True: the stored token, as transformers
    if not token:
        raise HubError("no Hugging Face token: set HF_TOKEN or run `hf auth login` (a token with write access)")
    with tempfile.TemporaryDirectory(prefix="eagle3_push_") as tmp:
        if isinstance(model_or_dir, (str, os.PathLike)):
            folder = Path(model_or_dir)
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"{folder} is not a drafter checkpoint directory (no config.json)")
        else:
            folder = _stage_model(model_or_dir, Path(tmp) / "model")
        source = folder
        folder = stage_in_dtype(folder, Path(tmp) / "upload", dtype, ALLOW_PATTERNS, IGNORE_PATTERNS)
        if gguf is not None:
            folder = _stage_with(folder, Path(gguf), Path(tmp) / "with_gguf")
        if run_check:
            # the engines that load what is uploaded: the standard layout's, and llama.cpp with a GGUF beside it
            engines = SERVERS + (("llamacpp",) if gguf else ())
            findings = check_drafter(folder, verifier=_local_verifier(folder), engine=engines)
            if any(f.level == "error" for f in findings):
                raise DrafterCheckError(findings)
            for f in findings:
                if f.level == "warning":
                    logger.warning("check: %s", f)
        api = HfApi(token=token)
        with hub_errors("create", repo_id, token):
            repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision not in (None, "main"):
            with hub_errors(f"create branch {revision!r} in", repo_id, token):
                api.create_branch(repo_id, branch=revision, exist_ok=True)
        serving = verifier_serving(_recorded_verifier(source), tensor_parallel, gpu_memory_gib)
        card = write_model_card(folder, repo_id, serving=serving)
        if tags:
            _add_tags(card, tags)
        with hub_errors("upload to", repo_id, token):
            info = api.upload_folder(
                repo_id=repo_id, folder_path=str(folder), revision=revision,
                commit_message=commit_message or "Upload EAGLE-3 drafter (eagle3_hf)",
                commit_description=commit_description, create_pr=create_pr,
                allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS,
            )
    logger.info("pushed %s: %s", repo_id, info.commit_url)
    return info  # a CommitInfo: the commit URL as a str, with .oid, like PreTrainedModel.push_to_hub


def _add_tags(card_path: Path, tags: list[str]) -> None:
    """The card's tags plus `tags` (push_to_hub's argument), in the card's YAML header."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(card_path)
    card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *tags]))
    card.save(card_path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="drafter checkpoint directory (config.json + model.safetensors)")
    parser.add_argument("--repo-id", required=True, help="ORG/NAME on the Hub")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--revision", default=None, help="branch to push to (created from main if missing)")
    parser.add_argument("--commit-message", default=None)
    parser.add_argument("--no-check", action="store_true", help="push even if `eagle3-hf check` finds errors")
    parser.add_argument("--dtype", choices=list(PUSH_DTYPES), default=DEFAULT_PUSH_DTYPE,
                        help="the floating weights' dtype on the Hub (default %(default)s, what the engines run the "
                             "drafter in; d2t and t2d keep theirs); the card states it")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="the verifier's tensor-parallel size in the card's serve commands (default: the fewest "
                             "GPUs of --gpu-memory-gib whose memory at 80 %% holds the verifier's weights, read from "
                             "its config and safetensors index)")
    parser.add_argument("--gpu-memory-gib", type=float, default=DEFAULT_GPU_GIB,
                        help="memory of one serving GPU, for the derived tensor-parallel size (H100 80, H200 141)")
    parser.add_argument("--gguf", default=None, help="the drafter's GGUF (`eagle3-hf export --format gguf`), uploaded "
                        "beside the standard layout for llama.cpp; checked for llama.cpp too")


def run(args: argparse.Namespace) -> int:
    """Token from HF_TOKEN or `hf auth login`; never from the command line, so it stays out of shell history."""
    try:
        url = push_drafter(args.checkpoint, args.repo_id, private=args.private, revision=args.revision,
                           commit_message=args.commit_message, run_check=not args.no_check, dtype=args.dtype,
                           tensor_parallel=args.tensor_parallel_size, gpu_memory_gib=args.gpu_memory_gib,
                           gguf=args.gguf)
    except (HubError, DrafterCheckError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(url)
    return 0
