"""The `FeatureSource` both vLLM routes share (routes/vllm_offline.py: an engine of our own in vLLM's venv;
routes/vllm_server_client.py: a running vLLM OpenAI server): the samples handed to a vLLM run, its files read into
shard samples by `VllmFeatureSpec` (vllm_spec.py) with several reader threads, and the route's facts. A route
subclasses it where its run differs (`check`, `open_run`, `report`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..interface import PreparedSample, SampleFeatures
from ..write import sample_token_limit
from .vllm_spec import VllmFeatureSpec, VllmOptions, default_readers


class VllmFeatures:
    """vLLM as a `FeatureSource`, with an engine of our own in vLLM's venv (`VllmExtraction`), `batch_size`
    prompts per call; `verifier` is the name a server is checked against (routes/vllm_server_client.py)."""

    def __init__(self, spec: VllmFeatureSpec, options: VllmOptions | None = None, verifier: str = ""):
        self.spec, self.identity = spec, spec.identity
        self.options, self.verifier = options or VllmOptions(), verifier
        self.readers = default_readers() if self.options.readers is None else max(1, int(self.options.readers))
        self.result: dict[str, Any] = {}
        self.peak = 0

    def check(self, lengths: Sequence[int]) -> int | None:
        """The most tokens a sample may have: --max-model-len's, less the generated token (write.sample_token_limit)."""
        return sample_token_limit(self.options.max_model_len)

    def open_run(self, request: dict[str, Any], prompts: Iterator[tuple[int, list[int]]]) -> Any:
        """The run that computes the states: vLLM in its venv, its files read back (engines/vllm/vllm_env.py)."""
        from ...engines.vllm.vllm_env import VllmExtraction

        options = self.options
        return VllmExtraction(request, prompts, threads=options.threads, debug=options.debug, timeout=options.timeout)

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        options = self.options
        longest = max((len(s.input_ids) for s in samples), default=0)  # the samples that fit (write.py)
        request = self.spec.request(int(options.max_model_len or longest + 1), options.batch_size,
                                    options.max_pending, dict(options.engine), options.connector)
        prompts = ((k, samples[k].input_ids.tolist()) for k in range(len(samples)))
        run = self.open_run(request, prompts)
        with run:
            yield from self.spec.features(run.records(), samples, readers=self.readers)
            self.result = run.result or {}
            self.peak = run.peak_pending_bytes

    def report(self) -> dict[str, Any]:
        """The route's facts; "connector" is None from a server (its answers do not name it), which adds its URL
        and how often its next token agreed with the verifier's head here."""
        out = {"engine": "vllm", "vllm_version": self.result.get("vllm_version"), "vllm_dtype": self.spec.vllm_dtype,
               "connector": self.result.get("connector"), "vllm_load_seconds": self.result.get("load_seconds"),
               "peak_temporary_bytes": self.peak, "readers": self.readers}
        if self.options.endpoint is not None:
            spec = self.spec
            out.update(endpoint=self.options.endpoint,
                       next_token_agreement=round(spec.next_token_agreements / max(spec.next_token_checks, 1), 4))
        return out
