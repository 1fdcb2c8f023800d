"""`extract --engine vllm --endpoint URL`: features from a running vLLM OpenAI server (`eagle3-hf serve-vllm`).

Fast tests run against a stand-in (tests/helpers/completions_stub.py) that follows vLLM's protocol (the path in
kv_transfer_params, the file written later under LOCK_EX): the features equal the offline route's bit for bit,
the server's storage is left empty, a rerun sends nothing, and each misconfigured or failing server is one line
with no shard written. The slow test starts vLLM's own API server on the CPU build and compares with `extract`.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from eagle3_hf.cli import main
from eagle3_hf.evaluation.feature_diff import diff_features
from eagle3_hf.features.reader import FeatureDataset

from tests.helpers.completions_stub import CompletionsStub
from tests.helpers.feature_stub import offline_features
from tests.helpers.serveable import BF16_STEP, walk_prepared
from tests.helpers.vllm import vllm_or_fail

ROOT = Path(__file__).resolve().parents[2]
EAGLE3_HF = str(Path(sys.executable).parent / "eagle3-hf")


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    """A failing stub is retried as a server is (the stub counts the posts), without a real server's waits."""
    from eagle3_hf.features.routes import vllm_server_client

    monkeypatch.setattr(vllm_server_client, "RETRY_BACKOFF_S", 0.01)


@pytest.fixture
def prepared(tmp_path, fingerprint):
    return walk_prepared(tmp_path / "prepared", fingerprint, n=10)


def extract(url: str, serveable_dir: Path, prepared: Path, out: Path, *extra: str) -> int:
    return main(["extract", "--engine", "vllm", "--endpoint", url, "--verifier", str(serveable_dir), "--data",
                 str(prepared), "--output", str(out), "--samples-per-shard", "4", "--vllm-batch-size", "3",
                 "--no-progress", *extra])


def shards(out: Path) -> list[Path]:
    return sorted(out.glob("shard-*")) if out.exists() else []


def test_endpoint_features_equal_the_offline_route_and_the_storage_is_left_empty(
        tmp_path, serveable_model, serveable_dir, prepared, fingerprint, capsys):
    storage = tmp_path / "storage"
    with CompletionsStub(serveable_model, str(serveable_dir), storage) as stub:
        assert extract(stub.url, serveable_dir, prepared, tmp_path / "f") == 0
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        posts = stub.posts
        assert extract(stub.url, serveable_dir, prepared, tmp_path / "f") == 0  # a rerun: everything is done
        again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert stub.posts == posts == 10 and again["written_samples"] == 0 and again["resumed_past"] == 10
    assert summary["written_samples"] == 10 and summary["next_token_agreement"] == 1.0
    assert summary["vllm_version"] == "0.32.0" and summary["peak_temporary_bytes"] > 0
    assert sorted(os.listdir(storage)) == []  # every file and every lock taken and deleted

    reference = offline_features(serveable_model, prepared, tmp_path / "offline", fingerprint, "bfloat16")
    report = diff_features(reference, tmp_path / "f")
    assert report["samples_compared"] == 10 and report["token_mismatch"] == 0 and report["greedy_agreement"] == 1.0
    for name, stats in report["layers"].items():
        assert stats["rel_err_max"] == 0.0, (name, stats)
    assert FeatureDataset(tmp_path / "f", split="all").manifest["source"] == "vllm"


@pytest.mark.parametrize("behaviour, message", [
    ("plain", "answered without kv_transfer_params.hidden_states_path: it was not started with the extraction config"),
    ("foreign", "differs from the verifier's greedy token on its last saved state for all of the first 4 samples"),
    ("elsewhere", "writes its states to /nonexistent-storage, which this machine cannot see"),
    ("fail:1", "answered 500: engine dead"),
    ("full", "without writing /"),
])
def test_a_misconfigured_or_failing_server_is_one_line_and_no_shard(tmp_path, serveable_model, serveable_dir, prepared,
                                                                    behaviour, message, capsys):
    storage = tmp_path / "storage"
    with CompletionsStub(serveable_model, str(serveable_dir), storage, behaviour=behaviour) as stub:
        code = extract(stub.url, serveable_dir, prepared, tmp_path / "f")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert shards(tmp_path / "f") == []
    assert not storage.exists() or os.listdir(storage) == []  # taken files deleted, abandoned ones too


@pytest.mark.parametrize("stub_kwargs, message", [
    ({"root": "/models/another"}, "serves /models/another, not the verifier"),
    ({"layer_ids": [2, 3, 4, 6]}, "captures vLLM layer ids [2, 3, 4, 6]; this extraction needs [2, 4, 5, 6]"),
])
def test_a_server_for_something_else_is_refused_before_anything_is_written(tmp_path, serveable_model, serveable_dir,
                                                                           prepared, stub_kwargs, message, capsys):
    kwargs = {"root": str(serveable_dir), **stub_kwargs}
    with CompletionsStub(serveable_model, kwargs.pop("root"), tmp_path / "storage", **kwargs) as stub:
        code = extract(stub.url, serveable_dir, prepared, tmp_path / "f")
        assert stub.posts == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("server_len, flag, limit", [(20, [], 19), (512, ["--max-model-len", "25"], 24)])
def test_samples_the_context_cannot_take_are_skipped_and_counted(tmp_path, serveable_model, serveable_dir, prepared,
                                                                 capsys, server_len, flag, limit):
    """The shorter of the server's context and --max-model-len bounds the samples, less the generated token: the
    longer ones are skipped alone, counted in the summary and the manifest, and never sent."""
    import datasets

    lengths = {r["id"]: len(r["input_ids"]) for r in datasets.load_from_disk(str(prepared))}
    over = sorted(i for i, n in lengths.items() if n > limit)
    assert over and len(over) < len(lengths)
    with CompletionsStub(serveable_model, str(serveable_dir), tmp_path / "storage", max_model_len=server_len) as stub:
        assert extract(stub.url, serveable_dir, prepared, tmp_path / "f", *flag) == 0
        assert stub.posts == len(lengths) - len(over)
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["skipped"] == {"overlong": len(over)} and summary["max_sample_tokens"] == limit
    assert f"skipped {len(over)} samples of more than {limit} tokens" in captured.err
    ds = FeatureDataset(tmp_path / "f", split="all")
    assert sorted(ds.manifest["skipped_ids"]["overlong"]) == over and ds.manifest["skipped"] == {"overlong": len(over)}
    assert sorted(ds.sample_ids) == sorted(i for i in lengths if i not in over)


def test_a_writer_that_never_finishes_times_out(tmp_path, serveable_model, serveable_dir, prepared, capsys):
    storage = tmp_path / "storage"
    with CompletionsStub(serveable_model, str(serveable_dir), storage, behaviour="never") as stub:
        code = extract(stub.url, serveable_dir, prepared, tmp_path / "f", "--vllm-timeout", "1")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "did not finish writing" in err[0] and "within 1 s" in err[0], err
    assert os.listdir(storage) == [] and shards(tmp_path / "f") == []


def test_a_server_that_dies_mid_run_loses_nothing_the_rerun_completes(tmp_path, serveable_model, serveable_dir,
                                                                        prepared, fingerprint, capsys):
    storage = tmp_path / "storage"
    with CompletionsStub(serveable_model, str(serveable_dir), storage, behaviour="fail:7") as stub:
        assert extract(stub.url, serveable_dir, prepared, tmp_path / "f") == 1
    assert "answered 500" in capsys.readouterr().err
    partial = FeatureDataset(tmp_path / "f", split="all", allow_partial=True)
    assert 0 < len(partial) < 10
    with CompletionsStub(serveable_model, str(serveable_dir), storage) as stub:
        assert extract(stub.url, serveable_dir, prepared, tmp_path / "f") == 0
        assert stub.posts == 10 - len(partial)  # only what was missing
    assert os.listdir(storage) == []
    report = diff_features(offline_features(serveable_model, prepared, tmp_path / "offline", fingerprint, "bfloat16"),
                           tmp_path / "f")
    assert report["samples_compared"] == 10 and report["only_in_b"] == 0
    assert all(stats["rel_err_max"] == 0.0 for stats in report["layers"].values())


def test_no_server_and_endpoint_without_vllm_engine_are_one_line(tmp_path, serveable_dir, prepared, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert extract(f"http://127.0.0.1:{port}", serveable_dir, prepared, tmp_path / "f") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no server answers at http://127.0.0.1:{port}" in err[0], err
    assert "eagle3-hf serve-vllm" in err[0] and not (tmp_path / "f").exists()
    assert main(["extract", "--endpoint", "http://127.0.0.1:1", "--verifier", str(serveable_dir), "--data",
                 str(prepared), "--output", str(tmp_path / "g")]) == 1
    assert capsys.readouterr().err.strip() == ("error: --endpoint URL needs --engine vllm or --engine sglang (a "
                                               "running server computes the states); --engine transformers runs no "
                                               "server")


def test_the_printed_server_command_is_the_extraction_config(serveable_dir, capsys):
    assert main(["serve-vllm", "--verifier", str(serveable_dir), "--port", "8123", "--storage", "/data/hs",
                 "--connector", "cpu", "--print-command"]) == 0
    line = capsys.readouterr().out.strip()
    env, python, *argv = shlex.split(line)
    assert env == f"PYTHONPATH={ROOT / 'eagle3_hf' / 'engines' / 'vllm'}"  # where vLLM finds the CPU connector
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    args = {key: argv[i + 1] for i, key in enumerate(argv[:-1]) if key.startswith("--")}
    spec = json.loads(args["--speculative-config"])
    assert spec["method"] == "extract_hidden_states"
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 6]
    kv = json.loads(args["--kv-transfer-config"])
    assert kv["kv_connector"] == "CpuHiddenStatesConnector" and kv["kv_connector_module_path"] == "vllm_hidden_states"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/data/hs", "use_synchronization_lock": True}
    assert "--no-enable-prefix-caching" in argv and args["--port"] == "8123" and args["--dtype"] == "float32"
    names = argv[argv.index("--served-model-name") + 1:]
    assert names == [str(serveable_dir), "eagle3-hf-layers-2-4-5-6", "eagle3-hf-storage-/data/hs"]


# ---------------------------------------------------------------- slow: vLLM's own API server on its CPU build


@pytest.mark.slow
def test_vllm_openai_server_features_equal_extracts(tmp_path, serveable_model, serveable_dir, fingerprint):
    vllm_or_fail()
    from eagle3_hf.engines.vllm.vllm_openai import VllmOpenAIServer
    from eagle3_hf.features.routes.transformers import extract_features
    from eagle3_hf.features.write import StoreOptions

    prepared = walk_prepared(tmp_path / "prepared", fingerprint, n=12)
    extract_features(serveable_model, fingerprint, prepared, tmp_path / "f_transformers", store=StoreOptions(4),
                     verifier_name=str(serveable_dir), progress=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "slow-test-key"  # vLLM's own --api-key (as VLLM_API_KEY): the client sends it from EAGLE3_HF_API_KEY
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", EAGLE3_HF_API_KEY=key)
    with VllmOpenAIServer(str(serveable_dir), [2, 4, 5, 6], port=port, dtype="float32", max_model_len=512,
                          timeout=600, api_key=key) as server:
        storage = server.storage
        with pytest.raises(urllib.error.HTTPError) as refused:  # no key: vLLM answers 401
            urllib.request.urlopen(server.url + "/v1/models", timeout=30)
        assert refused.value.code == 401
        result = subprocess.run([EAGLE3_HF, "extract", "--engine", "vllm", "--endpoint", server.url, "--verifier",
                                 str(serveable_dir), "--data", str(prepared), "--output", str(tmp_path / "f_vllm"),
                                 "--samples-per-shard", "4", "--vllm-batch-size", "4", "--no-progress"],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert key not in result.stdout + result.stderr + server._log_text()
        assert "does not name its storage directory" not in result.stderr  # the served name told the client
        assert os.listdir(storage) == ["pids"]  # every file and lock taken; the pids say whose directory it is
    assert not storage.exists()  # the server's storage goes with it
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["written_samples"] == 12 and summary["vllm_version"] == "0.32.0"
    assert summary["next_token_agreement"] == 1.0
    report = diff_features(tmp_path / "f_transformers", tmp_path / "f_vllm")
    assert report["samples_compared"] == 12 and report["token_mismatch"] == 0 and report["greedy_agreement"] == 1.0
    for name, stats in report["layers"].items():
        assert stats["rel_err_max"] <= BF16_STEP + 1e-4 and stats["cos_min"] > 0.9999, (name, stats)
