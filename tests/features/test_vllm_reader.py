"""`extract --engine vllm`'s reader: the connector's [T, layers, H] files -> shards. Several readers, work in the
storage dtype, one finiteness pass: the shards must stay byte for byte what the one fp32 reader wrote, a NaN is
still one line naming the sample, and a run stopped by it resumes with nothing lost or duplicated."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_hf.features.interface import PreparedSample, SampleFeatures
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.vllm_spec import VllmFeatureSpec
from eagle3_hf.features.write import StoreOptions, write_features
from eagle3_hf.verifier.capture import greedy_tokens

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
    `hidden_states`, `token_ids`) and reports it; `spec.features` reads them (or `old_features`, the reader as it
    was, when `old`). `poison` names samples whose file holds one NaN."""

    def __init__(self, spec: VllmFeatureSpec, storage: Path, file_dtype: torch.dtype, readers: int = 1,
                 old: bool = False, poison: Sequence[str] = ()):
        self.spec, self.identity, self.storage = spec, spec.identity, storage
        self.file_dtype, self.readers, self.old, self.poison = file_dtype, readers, old, set(poison)
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
        if self.old:
            yield from old_features(self.spec, self.records(samples), samples)
        else:
            yield from self.spec.features(self.records(samples), samples, readers=self.readers)

    def report(self) -> dict[str, Any]:
        return {}


@torch.no_grad()
def old_features(spec: VllmFeatureSpec, records: Iterator[dict[str, Any]], samples: Sequence[PreparedSample]
                 ) -> Iterator[SampleFeatures]:
    """The reader as it was before several readers: the whole file copied to float32, mapped, handed to the writer
    as float32 (the writer rounded it to the storage dtype). The reference the shards must equal byte for byte."""
    slot = {lid: j for j, lid in enumerate(spec.layer_ids)}
    for record in records:
        sample = samples[int(record["key"])]
        states = load_file(record["path"])["hidden_states"].float()
        assert torch.isfinite(states).all()
        aux = torch.cat([states[:, slot[int(i)]] for i in spec.indices], dim=-1)
        where = next(spec.norm.parameters()).device
        last = spec.norm(states[:, slot[spec.layer_ids[-1]]].to(where))
        greedy = greedy_tokens(spec.head, last, spec.softcap)
        Path(record["path"]).unlink()
        yield SampleFeatures(sample, aux, last.to(states.device), greedy.to(states.device))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, fingerprint):
    return make_prepared(tmp_path_factory.mktemp("prepared"), fingerprint, n=11, lo=1, hi=60)


def spec_for(verifier: Path, fingerprint: str, dtype: str) -> VllmFeatureSpec:
    return VllmFeatureSpec(str(verifier), fingerprint, AUX, dtype, verifier_name="tiny", vllm_dtype="bfloat16")


def files(out: Path) -> dict[str, str]:
    """sha256 of every file of a feature directory (shards, journal, manifest), each shard's `written` stat aside."""
    return feature_files(out)


@pytest.mark.parametrize("file_dtype, dtype, readers", [
    (torch.bfloat16, "bf16", 3),  # what vLLM writes on a GPU, stored as is
    (torch.float32, "bf16", 2),  # vLLM's CPU build on a float32 checkpoint: rounded once, as before
    (torch.bfloat16, "fp8", 3),
    (torch.float32, "fp32", 1),
])
def test_shards_are_byte_identical_to_the_fp32_reader(tmp_path, tiny_verifier_dir, fingerprint, prepared,
                                                       file_dtype, dtype, readers):
    spec = spec_for(tiny_verifier_dir, fingerprint, dtype)
    before, after = tmp_path / "before", tmp_path / "after"
    old = ConnectorFiles(spec, tmp_path / "old_states", file_dtype, old=True)
    new = ConnectorFiles(spec, tmp_path / "new_states", file_dtype, readers=readers)
    a = write_features(old, prepared, before, store=StoreOptions(samples_per_shard=3), progress=False,
                       merge_timeout_s=0)
    b = write_features(new, prepared, after, store=StoreOptions(samples_per_shard=3, writers=readers),
                       progress=False, merge_timeout_s=0)  # as extract --engine vllm: a writer per reader
    assert a.written_samples == b.written_samples == 11 and a.written_tokens == b.written_tokens
    assert files(before) == files(after)  # shards, journal (per-sample and per-shard sha256) and manifest
    assert len([p for p in after.iterdir() if p.suffix == ".safetensors"]) == 4
    assert not any(new.storage.iterdir())  # every connector file deleted once read


def test_a_nan_stops_the_run_naming_the_sample_and_the_rerun_completes_it(tmp_path, tiny_verifier_dir, fingerprint,
                                                                          prepared):
    spec = spec_for(tiny_verifier_dir, fingerprint, "bf16")
    store = StoreOptions(samples_per_shard=2, writers=3)
    out, clean = tmp_path / "out", tmp_path / "clean"
    bad = ConnectorFiles(spec, tmp_path / "bad_states", torch.bfloat16, readers=3, poison=["s006"])
    with pytest.raises(ValueError) as err:
        write_features(bad, prepared, out, store=store, progress=False, merge_timeout_s=0)
    text = str(err.value)
    assert "non-finite hidden states for sample 's006' at vLLM layer ids [3]" in text and "\n" not in text
    assert "s006.safetensors" in text
    first = FeatureDataset(out, split="all", allow_partial=True)
    assert sorted(first.sample_ids) == [f"s{i:03d}" for i in range(6)]  # everything before it, committed
    again = ConnectorFiles(spec, tmp_path / "states", torch.bfloat16, readers=3)
    summary = write_features(again, prepared, out, store=store, progress=False, merge_timeout_s=0)
    assert summary.resumed_past == 6 and summary.written_samples == 5 and summary.total_samples == 11
    write_features(ConnectorFiles(spec, tmp_path / "clean_states", torch.bfloat16), prepared, clean, store=store,
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
