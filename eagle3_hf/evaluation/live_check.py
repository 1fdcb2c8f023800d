"""`eagle3-hf check DRAFTER --endpoint URL`: ask a running vLLM or SGLang server that serves the drafter a few
prompts and compare what it accepts with what training measured (served_acceptance.py says how).

The engines report acceptance differently, as read in their source:

- vLLM (0.32, `vllm/v1/spec_decode/metrics.py`): Prometheus counters on GET /metrics,
  `vllm:spec_decode_num_drafts_total` (verify steps that scored drafts) and
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="j"}` (steps that accepted drafts 0..j), one
  label set per engine. They are server-wide and cumulative: read before and after the prompts, the difference
  is theirs (so nothing else may use the server meanwhile).
- SGLang (0.5.23, `srt/entrypoints/openai/serving_chat.py`, `srt/managers/tokenizer_manager.py`): a chat
  completion asked with `return_spec_tokens_details` answers `sglext.spec_tokens_details` with
  `spec_verify_ct` (verify steps), `spec_correct_drafts_histogram` (steps by accepted drafts; older releases:
  `spec_accept_histogram` in the native meta_info) and `spec_num_proposed_drafts`; the drafts per step, k, is
  `speculative_num_steps` from GET /server_info (else proposed / verify steps, a chain's k).

Prompts go to /v1/chat/completions one at a time (the server renders them with the verifier's chat template, as
it serves), greedy (temperature 0: acceptance then tests the drafter's argmax, the quantity training recorded), each
with the drafter's recorded thinking mode as `chat_template_kwargs` (a request's own kwargs override the server's
`--default-chat-template-kwargs` in both engines), so the text served is the kind the drafter was validated on.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engines.table import engine_row, live_engines
from ..errors import EndpointError, UsageError
from ..publish.served_acceptance import ServedCounts

REQUEST_TIMEOUT_S = 900.0  # one greedy answer of --max-new-tokens tokens; a CPU server is slow
BODY_LIMIT = 16 << 20  # bytes of one answer (/metrics of a busy server is a few hundred KiB)
VLLM_PREFIX = "vllm:spec_decode_"
_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _get(url: str, key: str | None, timeout: float = 30.0, body: dict | None = None) -> bytes:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read(BODY_LIMIT + 1)
    if len(raw) > BODY_LIMIT:
        raise EndpointError(f"{url} sent more than {BODY_LIMIT >> 20} MiB for one answer: refused")
    return raw


def _json(url: str, key: str | None, timeout: float = 30.0, body: dict | None = None) -> Any:
    try:
        return json.loads(_get(url, key, timeout, body))
    except urllib.error.HTTPError as exc:
        detail = exc.read(2000).decode("utf-8", "replace").strip().replace("\n", " ")
        raise EndpointError(f"{url} answered {exc.code}: {detail[:300] or exc.reason}") from None
    except urllib.error.URLError as exc:
        raise EndpointError(f"no server answers at {url} ({exc.reason}): start the engine serving the drafter "
                            "first (the model card's serve line)") from None
    except json.JSONDecodeError:
        raise EndpointError(f"{url} answered something that is not JSON") from None


def parse_vllm_counters(text: str) -> dict[str, Any]:
    """vLLM's spec-decode counters in Prometheus text, summed over label sets (engines):
    {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "per_pos": [by position]}; None values when absent."""
    totals: dict[str, Any] = {"num_drafts": None, "num_draft_tokens": None, "num_accepted_tokens": None}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if not match or not match.group(1).startswith(VLLM_PREFIX) or not match.group(1).endswith("_total"):
            continue
        name = match.group(1)[len(VLLM_PREFIX):-len("_total")]
        value = float(match.group(3))
        if name == "num_accepted_tokens_per_pos":
            labels = dict(_LABEL.findall(match.group(2) or ""))
            position = int(labels.get("position", -1))
            if position >= 0:
                per_pos[position] = per_pos.get(position, 0.0) + value
        elif name in totals:
            totals[name] = (totals[name] or 0.0) + value
    totals["per_pos"] = [per_pos.get(j, 0.0) for j in range(max(per_pos) + 1)] if per_pos else []
    return totals


def vllm_difference(before: dict[str, Any], after: dict[str, Any], prompts: int, engine: str) -> ServedCounts:
    """The counts of the prompts sent: after minus before."""
    if after["num_drafts"] is None or not after["per_pos"]:
        raise EndpointError(f"{engine} reports no speculative-decoding counters: it serves no drafter (start it "
                            "with --speculative-config '{\"method\": \"eagle3\", \"model\": DRAFTER, ...}')")
    prior = before["per_pos"] + [0.0] * (len(after["per_pos"]) - len(before["per_pos"]))
    drafts = round(after["num_drafts"] - (before["num_drafts"] or 0.0))
    per_pos = tuple(round(a - b) for a, b in zip(after["per_pos"], prior))
    return ServedCounts(engine, drafts, per_pos, prompts)


def sglang_counts(details: Sequence[dict[str, Any]], k: int | None, prompts: int, engine: str) -> ServedCounts:
    """Per-request spec details (SGLang) summed: verify steps, and per position the steps accepting past it."""
    histogram: list[int] = []
    steps = proposed = 0
    for d in details:
        hist = d.get("spec_correct_drafts_histogram") or d.get("spec_accept_histogram") or []
        histogram += [0] * (len(hist) - len(histogram))
        for n, count in enumerate(hist):
            histogram[n] += int(count)
        steps += int(d.get("spec_verify_ct") or 0)
        proposed += int(d.get("spec_num_proposed_drafts") or 0)
    if not steps or not histogram:
        raise EndpointError(f"{engine} returned no per-step acceptance (spec_correct_drafts_histogram): it serves "
                            "no drafter, or an SGLang release without return_spec_tokens_details")
    k = k or (proposed // steps if proposed else len(histogram) - 1)
    per_pos = tuple(sum(histogram[j + 1:]) for j in range(k))
    return ServedCounts(engine, sum(histogram), per_pos, prompts)


def _find_key(tree: Any, key: str) -> Any:
    """The first value of `key` anywhere in a JSON tree (SGLang nests its server arguments by release)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = _find_key(item, key)
            if found is not None:
                return found
    return None


def served_model(url: str, key: str | None) -> str:
    models = _json(url + "/v1/models", key).get("data") or []
    if not models or not isinstance(models[0], dict) or not models[0].get("id"):
        raise EndpointError(f"{url}/v1/models lists no model")
    return str(models[0]["id"])


def detect_engine(url: str, key: str | None) -> str:
    """"vllm" when /metrics carries vLLM's counters, else "sglang" when /server_info answers."""
    try:
        if "vllm:" in _get(url + "/metrics", key).decode("utf-8", "replace"):
            return "vllm"
    except (OSError, ValueError):
        pass
    try:
        _json(url + "/server_info", key)
        return "sglang"
    except EndpointError:
        pass
    raise EndpointError(f"{url} is neither a vLLM server (no vllm: counters on /metrics) nor an SGLang one (no "
                        "/server_info): pass --engine vllm or sglang, or check the URL")


def measure(url: str, prompts: Sequence[str], max_new_tokens: int, engine: str = "all", key: str | None = None,
            model: str | None = None, progress: Callable[[str], None] | None = None,
            chat_template_kwargs: Mapping[str, Any] | None = None) -> ServedCounts:
    """Send `prompts` (one user turn each) to the server at `url`, greedy, one at a time; its acceptance counts.
    `chat_template_kwargs` (the drafter's recorded thinking mode) go with every request, so the server renders the
    prompts in the mode the drafter was trained in whatever its --default-chat-template-kwargs."""
    url = url.rstrip("/")
    engine = detect_engine(url, key) if engine == "all" else engine
    if engine not in live_engines():
        readable = " or ".join(engine_row(e).label for e in live_engines())
        raise UsageError(f"--endpoint: the live check reads {readable} counters, not {engine_row(engine).label}'s "
                         f"(measure its drafter with evaluate --engine {engine})")
    model = model or served_model(url, key)
    name = f"{engine_row(engine).label} at {url}"

    def ask(prompt: str, extra: dict[str, Any]) -> dict[str, Any]:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens,
                "temperature": 0.0, **extra}
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        return _json(url + "/v1/chat/completions", key, REQUEST_TIMEOUT_S, body)

    started = time.monotonic()
    if engine == "vllm":
        def counters() -> dict[str, Any]:
            try:
                return parse_vllm_counters(_get(url + "/metrics", key).decode("utf-8", "replace"))
            except urllib.error.URLError as exc:
                raise EndpointError(f"{url}/metrics did not answer ({exc}): vLLM serves it unless "
                                    "--disable-log-stats") from None

        before = counters()
        if before["num_drafts"] is None:
            vllm_difference(before, before, 0, name)  # raises: no drafter served
        for i, prompt in enumerate(prompts):
            ask(prompt, {})
            if progress:
                progress(f"prompt {i + 1}/{len(prompts)} ({time.monotonic() - started:.0f} s)")
        return vllm_difference(before, counters(), len(prompts), name)
    k = _find_key(_json(url + "/server_info", key), "speculative_num_steps")
    details: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts):
        answer = ask(prompt, {"return_spec_tokens_details": True})
        found: Any = (answer.get("sglext") or {}).get("spec_tokens_details") or answer.get("meta_info") or {}
        found = found[0] if isinstance(found, list) and found else found  # a list when n > 1
        details.append(found if isinstance(found, dict) else {})
        if progress:
            progress(f"prompt {i + 1}/{len(prompts)} ({time.monotonic() - started:.0f} s)")
    return sglang_counts(details, int(k) if k else None, len(prompts), name)


def resolve_drafter(path_or_repo: str, revision: str | None) -> Path:
    """The drafter's directory (a Hub repo id is downloaded: its JSON files only)."""
    from ..publish.check import resolve_checkpoint

    return resolve_checkpoint(path_or_repo, revision, ["*.json"])


def recorded_chat_template_kwargs(drafter_dir: Path) -> dict[str, Any]:
    """The chat-template kwargs the drafter's training text was rendered with (its config.json's
    `verifier_chat_template_kwargs`, either drafter kind); {} where none were recorded."""
    config = drafter_dir / "config.json"
    if not config.is_file():
        return {}
    try:
        found = json.loads(config.read_text()).get("verifier_chat_template_kwargs")
    except json.JSONDecodeError as exc:
        raise UsageError(f"{config} is not valid JSON ({exc})") from None
    return dict(found) if isinstance(found, dict) else {}
