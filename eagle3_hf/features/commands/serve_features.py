"""`eagle3-hf serve-features`: vLLM loaded once with extract_hidden_states, serving hidden states over HTTP.

The server (engines/vllm/vllm_feature_server.py, in the vLLM venv) answers a trainer started with
`--features URL`: token ids in, the states vLLM's connector wrote out (the file deleted once read).
It serves the layers `extract --engine vllm` captures (the aux indices + N) with the same engine settings,
and tells who it is on GET /identity: hidden size, layer count, aux indices, and the tokenizer fingerprint
computed here from the verifier's tokenizer, which a trainer compares with its prepared dataset's.

    eagle3-hf serve-features --verifier V --port 8100          # prints: feature server: http://127.0.0.1:8100 ...
    EAGLE3_HF_API_KEY=... eagle3-hf serve-features --verifier V --host 0.0.0.0 --tensor-parallel-size 8
                                                               # for a trainer elsewhere, which sets the same key

It runs in the foreground until Ctrl-C or SIGTERM; its temporary files go with it. Without an API key it
listens on loopback only (features/api_key.py); its identity names the verifier's config and head hashes
(verifier/identity.py), which a trainer checks against its --verifier.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...engines.vllm.vllm_args import add_engine_arguments, check_batched_tokens, check_offline, engine_from_args
from ...errors import debug_requested
from ...verifier.family import check_aux_indices, default_aux_indices
from ..api_key import API_KEY_ENV, api_key, check_bind
from ..engine_states import vllm_layer_ids
from ..vllm.vllm_spec import VllmOptions, checkpoint_dtype

if TYPE_CHECKING:
    from ...engines.vllm.vllm_feature_launcher import VllmFeatureServer

KEY_NOTE = f" and {API_KEY_ENV} set to the server's key"


@dataclass(frozen=True)
class ServerSettings:
    """What a server serves and where (the options `add_server_arguments` reads, as `serve-features` and
    `serve-vllm` share them), how vLLM runs it (`vllm`: the options record `extract --engine vllm` and
    `regenerate --engine vllm` read theirs into, here its dtype, context, engine settings, batch size, connector,
    threads and load timeout), and the feature server's queue."""

    verifier: str
    revision: str | None = None
    aux_indices: Sequence[int] | None = None
    host: str = "127.0.0.1"
    port: int = 0
    vllm: VllmOptions = field(default_factory=VllmOptions)
    fingerprint: str | None = None  # None: computed from the verifier's tokenizer
    max_queue: int = 64

    @classmethod
    def from_args(cls, args: argparse.Namespace, **vllm: Any) -> ServerSettings:
        """The shared options as parsed (`add_server_arguments`, `add_process_arguments`), `vllm` a command's own
        options of vLLM (the feature server's batch size, serve-vllm's connector)."""
        aux = tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers else None
        options = VllmOptions(dtype=args.torch_dtype, max_model_len=args.max_model_len, engine=engine_from_args(args),
                              threads=args.threads, timeout=args.timeout, debug=debug_requested(), **vllm)
        return cls(args.verifier, revision=args.revision, aux_indices=aux, host=args.host, port=args.port,
                   vllm=options, max_queue=getattr(args, "max_queue", 64))


def server_request(settings: ServerSettings) -> dict[str, Any]:
    """The feature server's request for `settings.verifier` (its config and tokenizer read here, its weights by
    vLLM): what the server process is sent, as JSON."""

    from ...data.fingerprint import tokenizer_fingerprint
    from ...verifier.checkpoint_files import CheckpointFiles
    from ...verifier.family import text_config
    from ...verifier.identity import teacher_hashes
    from ...verifier.loading import load_tokenizer, resolve_verifier

    verifier, revision, vllm = str(settings.verifier), settings.revision, settings.vllm
    engine = dict(vllm.engine or {})
    path = resolve_verifier(verifier)
    # config.json read as a file (its text_config where nested): no model class needed, so a family transformers
    # lacks (kimi_k2) serves without remote code in this process; vLLM gets --trust-remote-code itself
    config = text_config(CheckpointFiles(path, revision).config())
    layers = int(config["num_hidden_layers"])
    indices = check_aux_indices(settings.aux_indices or default_aux_indices(layers), layers)
    fingerprint = settings.fingerprint
    if fingerprint is None:
        fingerprint = tokenizer_fingerprint(load_tokenizer(verifier, revision=revision))
    dtype = checkpoint_dtype(path) if vllm.dtype == "auto" else vllm.dtype
    max_model_len = int(vllm.max_model_len or config.get("max_position_embeddings") or 4096)
    check_batched_tokens(dict(engine), max_model_len)
    return {"verifier": path, "name": verifier, "verifier_revision": revision,
            "verifier_identity": teacher_hashes(verifier, revision), "dtype": dtype,
            "max_model_len": max_model_len,
            "layer_ids": vllm_layer_ids(indices, layers), "aux_layer_indices": list(indices),
            "tokenizer_fingerprint": fingerprint, "host": settings.host, "port": int(settings.port),
            "engine": engine, "batch_size": int(vllm.batch_size), "connector": vllm.connector,
            "max_queue": int(settings.max_queue)}


def start_feature_server(settings: ServerSettings, *, log_file: str | Path | None = None,
                         api_key: str | None = None) -> VllmFeatureServer:
    """A VllmFeatureServer for `settings` (enter it to start; `.url` once it listens). Without `api_key` a host
    other than loopback is refused (one line) before anything loads."""
    from ...engines.vllm.vllm_env import vllm_python
    from ...engines.vllm.vllm_feature_launcher import VllmFeatureServer

    check_bind(settings.host, api_key, "serve-features")
    vllm_python()  # vLLM missing: one line, before anything loads
    vllm = settings.vllm
    return VllmFeatureServer(server_request(settings), threads=vllm.threads, debug=vllm.debug, timeout=vllm.timeout,
                             log_file=log_file, api_key=api_key)


def add_server_arguments(parser: argparse.ArgumentParser, *, host_help: str, port_default: int,
                         port_help: str | None = None) -> None:
    """The options `serve-features` and `serve-vllm` share, in their --help order: what is served (the
    verifier, its layers and engine settings: `ServerSettings.from_args`) and where. The address's
    help and the port's default differ: a feature server picks a free port, vLLM's server vLLM's usual one."""
    parser.add_argument("--verifier", default="smollm2-135m-instruct", help="verifier name, Hub id or local path")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--host", default="127.0.0.1", help=host_help)
    parser.add_argument("--port", type=int, default=port_default, help=port_help)
    parser.add_argument("--aux-layers", default=None,
                        help="three output_hidden_states indices a,b,c in 1..N-1 (default 2,N//2,N-3), as extract")
    parser.add_argument("--torch-dtype", default="auto",
                        help="vLLM's dtype (auto = the checkpoint's, as extract --engine vllm)")
    add_engine_arguments(parser)
    parser.add_argument("--api-key", default=None,
                        help=f"the key clients must send (default ${API_KEY_ENV}, which keeps it out of the process "
                             "list); without one the server listens on loopback only")


def add_process_arguments(parser: argparse.ArgumentParser, *, log_file_help: str) -> None:
    """The options both commands share for the vLLM process itself, after their own (--help order)."""
    parser.add_argument("--threads", type=int, default=1, help="vLLM's CPU threads")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds the model load may take (default $EAGLE3_HF_VLLM_TIMEOUT_S or 4 h)")
    parser.add_argument("--log-file", default=None, help=log_file_help)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, host_help="address to listen on (0.0.0.0 for trainers on other machines; "
                                           "default loopback)",
                         port_default=0, port_help="port (default 0: any free port, printed)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests prefilled together at most")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests waiting at most; past it a client is told to retry (503, Retry-After)")
    add_process_arguments(parser, log_file_help="vLLM's log (default: a temporary file)")


def run(args: argparse.Namespace) -> int:
    check_offline(engine_from_args(args))  # one vllm.LLM: data parallelism is one server per replica
    settings = ServerSettings.from_args(args, batch_size=args.batch_size)
    server = start_feature_server(settings, log_file=args.log_file, api_key=api_key(args.api_key))
    with server:
        who = server.identity
        print(f"feature server: {server.url} (verifier {who['verifier']}, hidden {who['hidden_size']}, "
              f"{who['num_hidden_layers']} layers, vLLM ids {who['layer_ids']}); train with --features "
              f"{server.url}{KEY_NOTE if server.api_key else ''}", flush=True)
        print(json.dumps({"url": server.url, "identity": who}), flush=True)

        def stop(*_: Any) -> None:
            server.terminate()  # the server stops and cleans up; wait() below then returns

        signal.signal(signal.SIGTERM, stop)
        try:
            code = server.wait()
        except KeyboardInterrupt:
            server.stop()
            code = 0
    print("feature server stopped", file=sys.stderr)
    return 0 if code in (0, -signal.SIGTERM) else code
