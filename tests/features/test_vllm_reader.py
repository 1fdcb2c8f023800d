"""`extract --engine vllm`'s reader: the connector's [T, layers, H] files -> shards. Several readers, work in the
storage dtype, one finiteness pass: the shards must hold the verifier's own features of the states in the files
(its final norm and lm_head run through transformers in float32, rounded as the shard stores them), the same bytes
whatever the number of readers, a NaN is still one line naming the sample, and a run stopped by it resumes with
nothing lost or duplicated."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from eagle3_hf.data.prepared_samples import PreparedDataset
from eagle3_hf.features.interface import PreparedSample, SampleFeatures
from eagle3_hf.features.quantize import as_stored
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.vllm.vllm_spec import VllmFeatureSpec
from eagle3_hf.features.write import StoreOptions, write_features

from tests.helpers.data import feature_files, make_prepared

AUX = (5, 1, 3)  # given out of order: vLLM stores them ascending, the shard in this order


def connector_states(sample: PreparedSample, layers: int, hidden: int) -> torch.Tensor:
    """A sample's synthetic [T, layers, H] states (seeded by its id), with rows of very different magnitudes."""
    g = torch.Generator().manual_seed(int(sample.sample_id[1:]))
    t = sample.input_ids.numel()
    scale = torch.logspace(-2, 3, t)[:, None, None]
    return torch.randn(t, layers, hidden, generator=g) * scale


class ConnectorFiles:
    """A FeatureSource standing for vLLM's runner: it writes each sample's connector file (as the connector does:
    `hidden_states`, `token_ids`) and reports it; `spec.features` reads them. `poison` names samples whose file
    holds one NaN."""

    def __init__(self, spec: VllmFeatureSpec, storage: Path, file_dtype: torch.dtype, readers: int = 1,
                 poison: Sequence[str] = ()):
        self.spec, self.identity, self.storage = spec, spec.identity, storage
        self.file_dtype, self.readers, self.poison = file_dtype, readers, set(poison)
        storage.mkdir(parents=True, exist_ok=True)

    def check(self, lengths: Sequence[int]) -> None:
        pass

    def records(self, samples: Sequence[PreparedSample]) -> Iterator[dict[str, Any]]:
        for k, sample in enumerate(samples):
            states = connector_states(sample, len(self.spec.layer_ids), self.spec.hidden)
            if sample.sample_id in self.poison:
                states[states.shape[0] // 2, 1, 3] = float("nan")
            path = self.storage / f"{sample.sample_id}.safetensors"
            save_file({"hidden_states": states.to(self.file_dtype), "token_ids": sample.input_ids.clone()}, str(path))
            yield {"key": k, "path": str(path), "prompt_tokens": sample.input_ids.numel()}

    def states(self, samples: Sequence[PreparedSample]) -> Iterator[SampleFeatures]:
        yield from self.spec.features(self.records(samples), samples, readers=self.readers)

    def report(self) -> dict[str, Any]:
        return {}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, fingerprint):
    return make_prepared(tmp_path_factory.mktemp("prepared"), fingerprint, n=11, lo=1, hi=60)


@pytest.fixture(scope="module")
def opened(prepared, fingerprint):
    """The prepared samples as write_features takes them: checked against the route's tokenizer."""
    return PreparedDataset(prepared, "all", tokenizer_fingerprint=fingerprint)


def samples_of(prepared: Path) -> dict[str, PreparedSample]:
    """The prepared samples by id, as a route reads them."""
    import datasets

    rows = datasets.load_from_disk(str(prepared))
    return {r["id"]: PreparedSample(r["id"], torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"])) for r in rows}


def spec_for(verifier: Path, fingerprint: str, dtype: str) -> VllmFeatureSpec:
    return VllmFeatureSpec(str(verifier), fingerprint, AUX, dtype, verifier_name="tiny", vllm_dtype="bfloat16")


def files(out: Path) -> dict[str, str]:
    """sha256 of every file of a feature directory (shards, journal, manifest), each shard's `written` stat aside."""
    return feature_files(out)


@torch.no_grad()
def reference(verifier: torch.nn.Module, states: torch.Tensor, layer_ids: Sequence[int], dtype: str
              ) -> dict[str, torch.Tensor]:
    """What a shard of `dtype` must hold for a connector file's `states` [T, layers, H] (vLLM's layer ids
    `layer_ids`, ascending): the aux layers in AUX's order, the verifier's own final norm of the last layer and its
    greedy token, all in float32 through transformers, then rounded as the store rounds (quantize.as_stored)."""
    slot = {lid: j for j, lid in enumerate(layer_ids)}
    states = states.float()
    aux = torch.cat([states[:, slot[i]] for i in AUX], dim=-1)
    last = verifier.model.norm(states[:, slot[max(layer_ids)]])
    greedy = verifier.lm_head(last).argmax(-1)
    return {"aux_hidden_states": as_stored(aux, 3, dtype).float(),
            "last_hidden_state": as_stored(last, 1, dtype).float(),
            "verifier_greedy": greedy}


@pytest.mark.parametrize("file_dtype, dtype, readers", [
    (torch.bfloat16, "bf16", 3),  # what vLLM writes on a GPU, stored as is
    (torch.float32, "bf16", 2),  # vLLM's CPU build on a float32 checkpoint: rounded once
    (torch.bfloat16, "fp8", 3),
    (torch.float32, "fp32", 1),
])
def test_shards_hold_the_verifiers_own_features_whatever_the_readers(tmp_path, tiny_verifier_dir, fingerprint,
                                                                     prepared, opened, file_dtype, dtype, readers):
    from transformers import AutoModelForCausalLM

    spec = spec_for(tiny_verifier_dir, fingerprint, dtype)
    one, several = tmp_path / "one", tmp_path / "several"
    single = ConnectorFiles(spec, tmp_path / "one_states", file_dtype, readers=1)
    new = ConnectorFiles(spec, tmp_path / "new_states", file_dtype, readers=readers)
    a = write_features(single, opened, one, store=StoreOptions(samples_per_shard=3), progress=False,
                       merge_timeout_s=0)
    b = write_features(new, opened, several, store=StoreOptions(samples_per_shard=3, writers=readers),
                       progress=False, merge_timeout_s=0)  # as extract --engine vllm: a writer per reader
    assert a.written_samples == b.written_samples == 11 and a.written_tokens == b.written_tokens
    assert files(one) == files(several)  # shards, journal (per-sample and per-shard sha256) and manifest
    assert len([p for p in several.iterdir() if p.suffix == ".safetensors"]) == 4
    assert not any(new.storage.iterdir())  # every connector file deleted once read

    verifier = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    got = FeatureDataset(several, split="all")
    samples = samples_of(prepared)
    assert sorted(got.sample_ids) == sorted(samples)
    for index, sid in enumerate(got.sample_ids):
        states = connector_states(samples[sid], len(spec.layer_ids), spec.hidden).to(file_dtype)
        want, read = reference(verifier, states, spec.layer_ids, dtype), got[index]
        assert torch.equal(read["input_ids"], samples[sid].input_ids), sid
        for key in ("aux_hidden_states", "last_hidden_state", "verifier_greedy"):
            assert torch.equal(read[key], want[key]), (sid, key)


def test_a_nan_stops_the_run_naming_the_sample_and_the_rerun_completes_it(tmp_path, tiny_verifier_dir, fingerprint,
                                                                          opened):
    spec = spec_for(tiny_verifier_dir, fingerprint, "bf16")
    store = StoreOptions(samples_per_shard=2, writers=3)
    out, clean = tmp_path / "out", tmp_path / "clean"
    bad = ConnectorFiles(spec, tmp_path / "bad_states", torch.bfloat16, readers=3, poison=["s006"])
    with pytest.raises(ValueError) as err:
        write_features(bad, opened, out, store=store, progress=False, merge_timeout_s=0)
    text = str(err.value)
    assert "non-finite hidden states for sample 's006' at vLLM layer ids [3]" in text and "\n" not in text
    assert "s006.safetensors" in text
    first = FeatureDataset(out, split="all", allow_partial=True)
    assert sorted(first.sample_ids) == [f"s{i:03d}" for i in range(6)]  # everything before it, committed
    again = ConnectorFiles(spec, tmp_path / "states", torch.bfloat16, readers=3)
    summary = write_features(again, opened, out, store=store, progress=False, merge_timeout_s=0)
    assert summary.resumed_past == 6 and summary.written_samples == 5 and summary.total_samples == 11
    write_features(ConnectorFiles(spec, tmp_path / "clean_states", torch.bfloat16), opened, clean, store=store,
                   progress=False, merge_timeout_s=0)
    got, want = FeatureDataset(out, split="all"), FeatureDataset(clean, split="all")
    assert sorted(got.sample_ids) == sorted(want.sample_ids) and len(set(got.sample_ids)) == 11
    for sid in want.sample_ids:
        x, y = got[got.sample_ids.index(sid)], want[want.sample_ids.index(sid)]
        for key in ("input_ids", "aux_hidden_states", "last_hidden_state", "verifier_greedy"):
            assert torch.equal(x[key], y[key]), (sid, key)


@pytest.mark.parametrize("flag, value, message", [("--vllm-readers", "0", "--vllm-readers 0: must be at least 1"),
                                                  ("--vllm-max-pending", "-1", "--vllm-max-pending -1: must be at "
                                                                               "least 0")])
def test_reader_options_out_of_range_are_one_line(tmp_path, capsys, tiny_verifier_dir, prepared, flag, value,
                                                  message):
    from eagle3_hf.cli import main

    capsys.readouterr()
    code = main(["extract", "--engine", "vllm", "--verifier", str(tiny_verifier_dir), "--data", str(prepared),
                 "--output", str(tmp_path / "out"), flag, value])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err == f"error: {message}"
    assert not (tmp_path / "out").exists()
