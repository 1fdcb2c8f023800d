"""`eagle3-hf serve-vllm`: vLLM's own OpenAI server, started with the extraction config.

The route a run at scale takes when the verifier is already served by vLLM: one server (tensor parallel as
vLLM does it), and `extract --engine vllm --endpoint URL` as its client on the same machine. The server
captures the layers `extract --engine vllm` captures (the aux indices + N) with the same engine settings
(engines/vllm/vllm_openai.py); every completion writes one hidden-states file into its storage directory, which
the client reads and deletes.

    eagle3-hf serve-vllm --verifier V --port 8000          # foreground; prints the URL and the client's command
    eagle3-hf serve-vllm --verifier V --tensor-parallel-size 8 --print-command   # the command, to run yourself

It runs until Ctrl-C or SIGTERM; a storage directory it made goes with it. The server also answers
ordinary completions (the states of every request are saved: give it to extraction only). With an API key
(--api-key or $EAGLE3_HF_API_KEY) vLLM answers only requests that carry it, and the client sends it from
$EAGLE3_HF_API_KEY; without one it listens on loopback only. The key is never printed: --print-command's
command reads it from $EAGLE3_HF_API_KEY where it runs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from ..api_key import API_KEY_ENV, api_key, check_bind
from .serve_features import ServerSettings, add_process_arguments, add_server_arguments, server_request

DEFAULT_PORT = 8000
PRINTED_STORAGE = "/tmp/eagle3_vllm_storage"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, host_help="address to listen on (default loopback)", port_default=DEFAULT_PORT)
    parser.add_argument("--connector", choices=["auto", "cpu", "stock"], default="auto",
                        help="vLLM's stock hidden-states connector (CUDA) or the project's CPU one (auto: by CUDA)")
    parser.add_argument("--storage", default=None,
                        help="the connector's directory (default: a fresh temporary one, removed at exit)")
    add_process_arguments(parser, log_file_help="vLLM's log (default: beside the storage directory)")
    parser.add_argument("--print-command", action="store_true",
                        help="print the server's command and exit (to run it on the serving machine yourself)")


def run(args: argparse.Namespace) -> int:
    from ...engines.vllm.vllm_env import VllmError, vllm_python
    from ...engines.vllm.vllm_openai import VllmOpenAIServer, server_arguments, shell_command

    key = api_key(args.api_key)
    check_bind(args.host, key, "serve-vllm")
    settings = ServerSettings.from_args(args, connector=args.connector)
    request = server_request(settings)
    engine: dict[str, Any] = {"dtype": request["dtype"], "max_model_len": request["max_model_len"],
                              "engine": request["engine"], "revision": args.revision,
                              "connector": settings.vllm.connector}
    client = (f"{API_KEY_ENV + '=... ' if key else ''}eagle3-hf extract --engine vllm --endpoint "
              f"http://{args.host}:{args.port} --verifier {args.verifier} --data prepared/ --output features/")
    if args.print_command:
        try:
            python: str | Path = vllm_python()
        except VllmError:
            python = "python"  # vLLM lives on the serving machine, not here
        argv = server_arguments(request["verifier"], request["layer_ids"], args.storage or PRINTED_STORAGE,
                                host=args.host, port=args.port, **engine)
        print(shell_command(python, argv, key_from=API_KEY_ENV if key else None))
        print(f"# then, on the same machine: {client}", file=sys.stderr)
        return 0
    vllm_python()  # vLLM missing: one line
    server = VllmOpenAIServer(request["verifier"], request["layer_ids"], port=args.port, host=args.host,
                              storage=args.storage, threads=settings.vllm.threads, timeout=settings.vllm.timeout,
                              log_file=args.log_file, debug=settings.vllm.debug, api_key=key, **engine)
    with server:
        print(f"vLLM OpenAI server: {server.url} (verifier {request['verifier']}, vLLM layer ids "
              f"{request['layer_ids']}, storage {server.storage}); extract with: {client}", flush=True)
        print(json.dumps({"url": server.url, "layer_ids": request["layer_ids"], "storage": str(server.storage)}),
              flush=True)

        def stop(*_: Any) -> None:
            server.terminate()

        signal.signal(signal.SIGTERM, stop)
        try:
            code = server.wait()
        except KeyboardInterrupt:
            code = 0
    print("vLLM OpenAI server stopped", file=sys.stderr)
    return 0 if code in (0, -signal.SIGTERM) else code
