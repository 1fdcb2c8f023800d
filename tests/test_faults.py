"""Faults the project promises to survive, each then re-run with the same command: a full disk mid-shard
during `extract`, an OpenAI-compatible endpoint dropping connections during `regenerate`, a SIGKILL during
`push`, and a SIGKILL during two-process ZeRO-3 training resumed from its checkpoint."""

from __future__ import annotations

import errno
import io

import pytest
import torch

from eagle3_hf import cli
from eagle3_hf.features import store as shards
from eagle3_hf.features.reader import FeatureDataset
from eagle3_hf.features.verify import STAMP

from tests.helpers.data import extract_in_process, make_prepared, manifest_without_stat


class _FullDisk(io.FileIO):
    """A file whose disk fills up halfway through the write of one shard."""

    def write(self, data):
        super().write(bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def test_enospc_mid_shard_keeps_complete_shards_and_rerun_resumes(tmp_path, tiny_verifier_dir, fingerprint,
                                                                    monkeypatch):
    prepared = make_prepared(tmp_path / "prep", fingerprint, n=10)
    full, failed = tmp_path / "full", tmp_path / "failed"
    extract_in_process(tiny_verifier_dir, prepared, full, fingerprint)
    real_open = open

    def open_filling_disk(path, mode="r", *args, **kwargs):
        if "shard-r000-00002" in str(path) and "w" in mode:  # the third shard
            return _FullDisk(path, "w")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(shards, "open", open_filling_disk, raising=False)
    with pytest.raises(OSError, match="No space left on device") as info:
        extract_in_process(tiny_verifier_dir, prepared, failed, fingerprint)
    assert "shard-r000-00002" in str(info.value) and "rerun" in str(info.value)
    assert not list(failed.glob("*.tmp"))  # the partial file is removed: it only holds the space a user needs
    partial = FeatureDataset(failed, split="all", allow_partial=True, verify="shard")  # every committed shard whole
    assert len(partial) == 4
    monkeypatch.undo()
    extract_in_process(tiny_verifier_dir, prepared, failed, fingerprint)
    names = sorted(p.name for p in full.iterdir())
    assert names == sorted(p.name for p in failed.iterdir() if p.name != STAMP)  # the reader's record aside
    for name in names:
        if name == "manifest.json":  # equal but for each shard file's own stat, taken when it was written
            assert manifest_without_stat(full / name) == manifest_without_stat(failed / name)
        elif not name.endswith(".jsonl"):
            assert (full / name).read_bytes() == (failed / name).read_bytes(), name
    assert len(FeatureDataset(failed, split="all")) == 10


# ---------------------------------------------------------------- regenerate against a failing endpoint

def test_endpoint_dropping_and_restarting_mid_run_loses_and_duplicates_nothing(tmp_path):
    import json
    import threading
    import time

    from eagle3_hf.data.regenerate import regenerate
    from eagle3_hf.data.regenerate_backends import EndpointBackend

    from tests.helpers.openai_stub import OpenAIStub, reply_for

    convs = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"}]} for i in range(12)]
    out = tmp_path / "out.jsonl"
    first = OpenAIStub(delay=0.05, drop={2, 5}).__enter__()  # two replies cut off mid-body
    port = first.server.server_address[1]
    backend = EndpointBackend(first.url, "m", max_retries=6, retry_backoff=0.2, timeout=10)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(
        stats=regenerate(convs, out, backend, concurrency=3, progress=False)))
    worker.start()
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().count("\n") >= 4):
        assert time.monotonic() < deadline and worker.is_alive()
        time.sleep(0.01)
    first.stop()  # killed: connections refused while it is down
    time.sleep(0.5)
    with OpenAIStub(port=port) as second:  # restarted on the same address
        worker.join(timeout=120)
        assert not worker.is_alive()
    assert result["stats"]["written"] == 12
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(c["id"] for c in convs)  # none lost, none twice
    for conv in convs:
        row = next(r for r in lines if r["id"] == conv["id"])
        assert row["messages"] == conv["messages"] + [{"role": "assistant", "content": reply_for(conv["messages"])}]
    asked = len(first.requests) + len(second.requests)
    assert 12 + 2 <= asked <= 12 * 7  # the cut replies were asked again; retries are bounded


def test_endpoint_that_stays_down_ends_with_one_clear_line(tmp_path, capsys):
    import socket

    from eagle3_hf.data.conversations import write_jsonl

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = tmp_path / "in.jsonl"
    write_jsonl(src, [{"id": "q0", "messages": [{"role": "user", "content": "hello"}]}])
    rc = cli.main(["regenerate", "--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--endpoint",
                   f"http://127.0.0.1:{port}", "--model", "m", "--max-retries", "1", "--wait-for-server", "0"])
    assert rc != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"error: conversation q0: http://127.0.0.1:{port}/v1/chat/completions: gave up after "
                              "2 attempts")
    assert "rerun to resume" in err[-1]


# ---------------------------------------------------------------- push killed between an upload and its commit

@pytest.mark.slow
def test_sigkill_during_push_then_rerun_leaves_the_repo_complete_and_consistent(tmp_path):
    import hashlib
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.helpers.drafters import write_drafter
    from tests.helpers.hub_server import TEST_ORGS, TEST_TOKENS, WRITE_TOKEN, HubServer, client_pointed_at

    root = Path(__file__).resolve().parents[1]
    src = write_drafter(tmp_path / "drafter")
    (src / "eagle3_training.json").write_text('{"verifier": "org/verifier", "metrics": {}}')
    weights = hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    with HubServer(tmp_path / "hub", orgs=TEST_ORGS, tokens=TEST_TOKENS, verify_delay=30.0) as hub:
        env = dict(hub.client_env(WRITE_TOKEN), PYTHONPATH=str(root), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "eagle3_hf.cli", "push", str(src), "--repo-id", "tester/killed", "--dtype",
               "fp32"]  # the checkpoint's own dtype: the files go up byte for byte
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
        blob = tmp_path / "hub" / "blobs" / weights
        deadline = time.monotonic() + 120
        while not blob.exists():  # the weights are uploaded; the client now waits on their verification
            assert proc.poll() is None and time.monotonic() < deadline, "push ended before it could be killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with client_pointed_at(hub.url, cache_dir=tmp_path / "cache"):
            from huggingface_hub import HfApi, hf_hub_download

            api = HfApi(token=WRITE_TOKEN)
            assert "model.safetensors" not in api.list_repo_files("tester/killed")  # nothing half-committed
            commits_before = len(api.list_repo_commits("tester/killed"))
            rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root)
            assert rerun.returncode == 0, rerun.stderr[-2000:]
            files = set(api.list_repo_files("tester/killed"))
            assert {"config.json", "model.safetensors", "README.md", "eagle3_training.json"} <= files
            for name in ("config.json", "model.safetensors", "eagle3_training.json"):
                got = Path(hf_hub_download("tester/killed", name, token=WRITE_TOKEN)).read_bytes()
                assert got == (src / name).read_bytes(), name
            assert len(api.list_repo_commits("tester/killed")) == commits_before + 1  # one commit, complete
            assert "org/verifier" in Path(hf_hub_download("tester/killed", "README.md", token=WRITE_TOKEN)).read_text()


# ---------------------------------------------------------------- ZeRO-3 training killed and resumed

@pytest.mark.slow
@pytest.mark.timeout(1200)  # 385 s measured (README, Development)
def test_sigkill_during_two_process_zero3_training_then_resume_matches_uninterrupted(synthetic, tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from safetensors import safe_open

    root = Path(__file__).resolve().parents[1]

    def command(out: Path, port: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(root / "accelerate_configs/cpu_2proc.yaml"), "--main_process_port", str(port),
                str(root / "examples/train.py"), "--verifier", str(synthetic["verifier_dir"]), "--features",
                str(synthetic["features"]), "--output-dir", str(out),
                "--deepspeed", str(root / "ds_configs/zero3.json"),
                "--num-train-epochs", "3", "--validation-fraction", "0.2", "--save-strategy", "steps",
                "--save-steps", "2", "--save-total-limit", "10", "--eval-strategy", "no", "--max-seq-len", "128",
                "--per-device-train-batch-size", "2", "--learning-rate", "1e-2", "--disable-tqdm", "true",
                "--seed", "7", *extra]

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    full, killed = tmp_path / "full", tmp_path / "killed"
    # the uninterrupted reference saves no checkpoint (ZeRO-3 saves gather every shard): saving changes no number
    done = subprocess.run(command(full, 29631, "--save-strategy", "no"), capture_output=True, text=True, timeout=900,
                          env=env, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads((full / "eagle3_training.json").read_text())["log_history"][-1]["step"]
    proc = subprocess.Popen(command(killed, 29632), env=env, cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not (killed / "checkpoint-4" / "trainer_state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "training ended before it could be killed"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, as a node failure would
    proc.wait()
    assert not (killed / "model.safetensors").exists()
    complete = sorted((p for p in killed.glob("checkpoint-*") if (p / "trainer_state.json").exists()),
                      key=lambda p: int(p.name.split("-")[1]))
    assert int(complete[-1].name.split("-")[1]) < steps
    resumed = subprocess.run(command(killed, 29633, "--resume-from-checkpoint", str(complete[-1])),
                             capture_output=True, text=True, timeout=900, env=env, cwd=root)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = json.loads((full / "eagle3_training.json").read_text())
    b = json.loads((killed / "eagle3_training.json").read_text())
    for key in ("step_accuracy", "step_conditional_accuracy"):
        assert b["metrics"][key] == pytest.approx(a["metrics"][key], abs=1e-6)
    assert b["metrics"]["simulated_acceptance_length"] == pytest.approx(a["metrics"]["simulated_acceptance_length"],
                                                                      abs=1e-6)
    assert b["log_history"][-1]["step"] == steps
    with safe_open(str(full / "model.safetensors"), framework="pt") as fa, \
            safe_open(str(killed / "model.safetensors"), framework="pt") as fb:
        assert set(fa.keys()) == set(fb.keys())
        for key in fa.keys():
            torch.testing.assert_close(fa.get_tensor(key), fb.get_tensor(key), atol=1e-6, rtol=1e-5)
