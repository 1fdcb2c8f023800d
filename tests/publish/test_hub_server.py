"""The loopback Hub server against the real huggingface_hub client: repos, LFS, commits, revisions, auth."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.helpers.hub_server import OTHER_TOKEN as OTHER
from tests.helpers.hub_server import READ_TOKEN as READ
from tests.helpers.hub_server import WRITE_TOKEN as WRITE
from tests.helpers.hub_server import HubServer, client_pointed_at


@pytest.fixture
def api(hub, tmp_path, monkeypatch):
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_TOKEN", WRITE)
    with client_pointed_at(hub.url, cache_dir=tmp_path / "cache"):
        yield HfApi()


def make_folder(path, config=b'{"hidden_size": 64}', weights=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_bytes(config)
    (path / "model.safetensors").write_bytes(weights if weights is not None else os.urandom(4096))
    (path / "README.md").write_text("---\nlibrary_name: transformers\ntags:\n- eagle3\n---\n\n# card\n")
    return path


def test_create_upload_list_download(api, tmp_path):
    from huggingface_hub import hf_hub_download, snapshot_download

    assert api.whoami()["name"] == "tester"
    assert api.create_repo("tester/round-trip").repo_id == "tester/round-trip"
    folder = make_folder(tmp_path / "src")
    commit = api.upload_folder(repo_id="tester/round-trip", folder_path=str(folder), commit_message="first")
    assert commit.commit_url.endswith(commit.oid)
    files = {".gitattributes", "README.md", "config.json", "model.safetensors"}
    assert set(api.list_repo_files("tester/round-trip")) == files
    tree = {f.path: f for f in api.list_repo_tree("tester/round-trip")}
    import hashlib

    weights = (folder / "model.safetensors").read_bytes()
    assert tree["model.safetensors"].lfs.sha256 == hashlib.sha256(weights).hexdigest()  # went through LFS
    assert tree["config.json"].lfs is None and tree["config.json"].size == len(b'{"hidden_size": 64}')
    info = api.model_info("tester/round-trip", files_metadata=True)
    assert info.sha == commit.oid and "eagle3" in info.tags and info.card_data.library_name == "transformers"
    assert {s.rfilename: s.size for s in info.siblings}["model.safetensors"] == len(weights)
    path = hf_hub_download("tester/round-trip", "model.safetensors")
    assert open(path, "rb").read() == weights
    snapshot = snapshot_download("tester/round-trip")
    assert sorted(os.listdir(snapshot)) == [".gitattributes", "README.md", "config.json", "model.safetensors"]


def test_file_metadata_and_range(api, tmp_path):
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    api.create_repo("tester/meta")
    weights = os.urandom(2048)
    commit = api.upload_folder(repo_id="tester/meta", folder_path=str(make_folder(tmp_path / "m", weights=weights)))
    meta = get_hf_file_metadata(hf_hub_url("tester/meta", "model.safetensors"))  # a HEAD request
    assert meta.commit_hash == commit.oid and meta.size == 2048
    import hashlib

    assert meta.etag == hashlib.sha256(weights).hexdigest()  # X-Linked-Etag of an LFS file
    request = urllib.request.Request(hf_hub_url("tester/meta", "model.safetensors"), headers={"Range": "bytes=2000-"})
    with urllib.request.urlopen(request) as response:
        assert response.status == 206 and response.read() == weights[2000:]


def test_branches_and_revisions(api, tmp_path):
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError

    api.create_repo("tester/revs")
    folder = make_folder(tmp_path / "r")
    first = api.upload_folder(repo_id="tester/revs", folder_path=str(folder))
    api.create_branch("tester/revs", branch="v2")
    with pytest.raises(HfHubHTTPError) as err:
        api.create_branch("tester/revs", branch="v2")
    assert err.value.response.status_code == 409
    api.create_branch("tester/revs", branch="v2", exist_ok=True)
    (folder / "config.json").write_bytes(b'{"hidden_size": 128}')
    second = api.upload_folder(repo_id="tester/revs", folder_path=str(folder), revision="v2", commit_message="v2")
    assert json.load(open(hf_hub_download("tester/revs", "config.json", revision="v2")))["hidden_size"] == 128
    assert json.load(open(hf_hub_download("tester/revs", "config.json")))["hidden_size"] == 64
    assert json.load(open(hf_hub_download("tester/revs", "config.json", revision=first.oid)))["hidden_size"] == 64
    refs = {b.name: b.target_commit for b in api.list_repo_refs("tester/revs").branches}
    assert refs == {"main": first.oid, "v2": second.oid}
    titles = [c.title for c in api.list_repo_commits("tester/revs", revision="v2")]
    assert titles[:2] == ["v2", "Upload folder using huggingface_hub"]
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("tester/revs", "config.json", revision="nope")


def test_lfs_content_is_verified(api, hub):
    api.create_repo("tester/lfs")
    oid, size = "0" * 64, 10
    batch = {"operation": "upload", "objects": [{"oid": oid, "size": size}]}
    auth = {"Authorization": f"Bearer {WRITE}"}
    request = urllib.request.Request(f"{hub.url}/tester/lfs.git/info/lfs/objects/batch", method="POST",
                                     data=json.dumps(batch).encode(), headers=auth)
    obj = json.load(urllib.request.urlopen(request))["objects"][0]
    put = urllib.request.Request(obj["actions"]["upload"]["href"], data=b"x" * size, method="PUT")
    with pytest.raises(urllib.error.HTTPError) as err:  # sha256 of the bytes is not the announced oid
        urllib.request.urlopen(put)
    assert err.value.code == 400
    lines = [{"key": "header", "value": {"summary": "x"}},
             {"key": "lfsFile", "value": {"path": "a.bin", "algo": "sha256", "oid": oid, "size": size}}]
    commit = urllib.request.Request(f"{hub.url}/api/models/tester/lfs/commit/main", method="POST", headers=auth,
                                    data="".join(json.dumps(line) + "\n" for line in lines).encode())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(commit)
    assert err.value.code == 422


def test_auth_conflicts_and_privacy(api, hub):
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError

    with pytest.raises(HfHubHTTPError) as err:
        HfApi(token="hf_not_a_real_token_000").whoami()
    assert err.value.response.status_code == 401 and "hf_not_a_real_token_000" not in str(err.value)
    with pytest.raises(HfHubHTTPError) as err:
        HfApi(token=READ).create_repo("reader/nope")
    assert err.value.response.status_code == 403
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo("other/not-mine")
    assert err.value.response.status_code == 403
    api.create_repo("eagle-org/shared")  # an org the user belongs to
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo("eagle-org/shared")
    assert err.value.response.status_code == 409
    assert api.create_repo("eagle-org/shared", exist_ok=True).repo_id == "eagle-org/shared"
    api.create_repo("tester/private", private=True)
    assert HfApi(token=WRITE).model_info("tester/private").private is True
    for token in (False, OTHER):
        with pytest.raises(RepositoryNotFoundError):
            hf_hub_download("tester/private", ".gitattributes", token=token)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("eagle-org/shared", "missing.json")


def test_subprocess_client_reads_hf_endpoint(hub, tmp_path):
    """The robust way: a fresh interpreter whose huggingface_hub reads HF_ENDPOINT at import."""
    script = (
        "import sys, json; from huggingface_hub import HfApi, hf_hub_download\n"
        "api = HfApi(); repo = api.create_repo('tester/from-subprocess').repo_id\n"
        "api.upload_file(path_or_fileobj=b'{\"a\": 1}', path_in_repo='config.json', repo_id=repo)\n"
        "cfg = json.load(open(hf_hub_download(repo, 'config.json')))\n"
        "print(json.dumps({'who': api.whoami()['name'], 'cfg': cfg}))\n"
    )
    env = hub.client_env(token=WRITE) | {"HF_HOME": str(tmp_path / "hf_home")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"who": "tester", "cfg": {"a": 1}}


def test_server_is_stopped_by_pid(tmp_path):
    server = HubServer(tmp_path / "hub2").start()
    pid = server.pid
    os.kill(pid, 0)  # running
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
