"""Storage of the test Hub server (tests/helpers/hub_server.py): repositories as commits of content-addressed
files, LFS blobs by sha256, branches and tokens. No HTTP here; the server maps its routes onto `Store`."""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import threading
import time
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".npy", ".npz",
                ".pkl", ".gguf", ".zip", ".tar", ".gz", ".arrow", ".parquet")
LFS_MIN_SIZE = 10 * 1024 * 1024
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()
SHA40 = re.compile(r"^[0-9a-f]{40}$")


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(oid: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n".encode()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())


def front_matter(text: str) -> dict | None:
    """README YAML metadata; ValueError if it does not parse to a mapping."""
    match = re.match(r"^---\s*\n(.*?)\n---\s*\n", text, re.S)
    if not match:
        return None
    import yaml  # the venv's python runs this server; pyyaml is a project dependency

    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as exc:
        raise ValueError(f"Invalid YAML: {exc}") from None
    if meta is not None and not isinstance(meta, dict):
        raise ValueError("metadata must be a mapping")
    return meta


def lfs_info(entry: dict, sha_key: str = "oid") -> dict:
    pointer = _lfs_pointer(entry["sha256"], entry["size"])
    return {sha_key: entry["sha256"], "size": entry["size"], "pointerSize": len(pointer)}


class Store:
    """Repos, branches and commits in memory; file contents as blobs (by sha256) under `root`."""

    def __init__(self, root: Path, tokens: dict[str, tuple[str, str]], orgs: dict[str, set[str]]):
        self.root, self.tokens, self.orgs = root, tokens, orgs
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        self.repos: dict[tuple[str, str], dict] = {}
        self.tickets: dict[str, tuple[str, int]] = {}
        self.lock = threading.RLock()

    def blob_path(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if not self.blob_path(sha).exists():
            self.blob_path(sha).write_bytes(data)
        return sha

    def can_write(self, user: str | None, role: str | None, namespace: str) -> bool:
        return user is not None and role == "write" and (namespace == user or user in self.orgs.get(namespace, ()))

    def repo(self, rtype: str, repo_id: str, user: str | None, role: str | None = None, write: bool = False) -> dict:
        repo = self.repos.get((rtype, repo_id))
        namespace = repo_id.split("/")[0]
        member = user is not None and (namespace == user or user in self.orgs.get(namespace, ()))
        if repo is None or (repo["private"] and not member):
            raise HubError(401 if user is None else 404, f"Repository {repo_id} not found", "RepoNotFound")
        if write and not self.can_write(user, role, namespace):
            raise HubError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    def create(self, rtype: str, repo_id: str, private: bool) -> None:
        repo = {"private": private, "created": _now(), "branches": {}, "commits": {}}
        sha = self._commit(repo, None, {".gitattributes": self._entry(GITATTRIBUTES)}, "initial commit", "")
        repo["branches"]["main"] = sha
        self.repos[(rtype, repo_id)] = repo

    def _entry(self, data: bytes) -> dict:
        return {"sha256": self.put_bytes(data), "size": len(data), "blob_id": _git_blob_id(data), "lfs": False}

    def _commit(self, repo: dict, parent: str | None, files: dict, title: str, message: str) -> str:
        sha = hashlib.sha1(f"{parent}{title}{time.time_ns()}{secrets.token_hex(8)}".encode()).hexdigest()
        repo["commits"][sha] = {"parent": parent, "files": files, "title": title, "message": message, "date": _now()}
        return sha

    def resolve(self, repo: dict, rev: str) -> str:
        rev = rev.removeprefix("refs/heads/")
        if rev in repo["branches"]:
            return repo["branches"][rev]
        if SHA40.match(rev) and rev in repo["commits"]:
            return rev
        raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

    def commit(self, repo: dict, branch: str, lines: list[dict], user: str) -> str:
        if branch not in repo["branches"]:
            raise HubError(404 if not SHA40.match(branch) else 400, f"Invalid rev id: {branch}", "RevisionNotFound")
        head = repo["branches"][branch]
        files = dict(repo["commits"][head]["files"])
        header = next((line["value"] for line in lines if line.get("key") == "header"), {})
        if header.get("parentCommit") and header["parentCommit"] != head:
            raise HubError(412, "A commit has happened since. Please refresh and try again.")
        for line in lines:
            key, value = line.get("key"), line.get("value", {})
            if key == "file":
                raw = value["content"]
                data = base64.b64decode(raw) if value.get("encoding") == "base64" else raw.encode()
                files[value["path"]] = self._entry(data)
            elif key == "lfsFile":
                oid = value["oid"]
                if not self.blob_path(oid).exists():
                    raise HubError(422, f"LFS object {oid} for {value['path']} was never uploaded")
                size = self.blob_path(oid).stat().st_size
                blob_id = _git_blob_id(_lfs_pointer(oid, size))  # git stores the pointer, LFS the content
                files[value["path"]] = {"sha256": oid, "size": size, "blob_id": blob_id, "lfs": True}
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, f"File {value['path']} does not exist", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {p: e for p, e in files.items() if not p.startswith(prefix)}
            elif key != "header":
                raise HubError(400, f"Unknown commit operation {key!r}")
        sha = self._commit(repo, head, files, header.get("summary") or "update", header.get("description", ""))
        repo["commits"][sha]["author"] = user
        repo["branches"][branch] = sha
        return sha
