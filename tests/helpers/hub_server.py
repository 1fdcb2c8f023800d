"""A small Hugging Face Hub API server for tests: the real `huggingface_hub` client talks to it.

No Hub server can be installed here, so this one implements the slice of the API that publishing and
loading a drafter use (shapes taken from huggingface_hub 2.x's own client code):

    GET  /api/whoami-v2                               bearer token -> user (401 on an unknown token)
    POST /api/repos/create, DELETE /api/repos/delete  409 when the repo exists
    GET  /api/{type}s/{repo}[/revision/{rev}]         model_info / repo_info (siblings, sha, cardData)
    GET  /api/{type}s/{repo}/tree/{rev}[/{path}]      list_repo_tree / list_repo_files
    GET  /api/{type}s/{repo}/refs | /commits/{rev}    list_repo_refs / list_repo_commits
    POST|DELETE /api/{type}s/{repo}/branch/{name}     create_branch (409 if it exists) / delete_branch
    POST /api/{type}s/{repo}/preupload/{rev}          regular vs LFS upload mode
    POST /{repo}.git/info/lfs/objects/batch           LFS batch API, "basic" transfer: an upload href on
    PUT  /__lfs/upload/{oid}?ticket=...               this server, sha256 + size verified on arrival
    POST /__lfs/verify
    POST /api/{type}s/{repo}/commit/{branch}          NDJSON: header, file (base64), lfsFile, deleted*
    POST /api/validate-yaml                           README front matter
    GET|HEAD /{repo}/resolve/{rev}/{path}             ETag, X-Repo-Commit, X-Linked-Etag/-Size, Range

Run it as a subprocess (`python -m tests.helpers.hub_server --root DIR --token TOK:user`, from the repository
root) through `HubServer`, which waits for the port and stops it by pid. The client reads HF_ENDPOINT when it is
imported: give a subprocess `HubServer.client_env()`, or use `client_pointed_at(url)` in-process. Xet uploads are
disabled there (`HF_HUB_DISABLE_XET`): this server speaks the plain LFS protocol only.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from .hub_storage import LFS_MIN_SIZE, LFS_SUFFIXES, HubError, Store, front_matter, lfs_info

# tokens the test server accepts (tests/conftest.py's `hub` fixture); never real credentials
WRITE_TOKEN, READ_TOKEN, OTHER_TOKEN = "hf_test_write_0123456789", "hf_test_read_0123456789", "hf_test_other_0123456789"
TEST_TOKENS = {WRITE_TOKEN: "tester:write", READ_TOKEN: "reader:read", OTHER_TOKEN: "other:write"}
TEST_ORGS = {"eagle-org": ["tester"]}
REPO_ROOT = Path(__file__).resolve().parents[2]  # where `python -m tests.helpers.hub_server` finds the package

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "TestHub/1.0"
    store: Store
    verify_delay: float = 0.0

    def log_message(self, *args) -> None:  # quiet; never echo request headers (they carry the token)
        pass

    # -- plumbing -----------------------------------------------------------------------------------
    @property
    def base(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{self.headers.get('Host') or f'{host}:{port}'}"

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _json(self) -> dict:
        return json.loads(self.body) if self.body else {}

    def _send(self, status: int, payload=None, headers: dict | None = None, raw: bytes | None = None,
              length: int | None = None) -> None:
        data = raw if raw is not None else (b"" if payload is None else json.dumps(payload).encode())
        self.send_response(status)
        if raw is None:
            self.send_header("Content-Type", "application/json")
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _user(self) -> tuple[str | None, str | None]:
        auth = self.headers.get("Authorization", "")
        if not auth.lower().startswith("bearer "):
            return None, None
        token = auth[7:].strip()
        if token not in self.store.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        return self.store.tokens[token]

    def _dispatch(self) -> None:
        try:
            self.body = self._read_body()  # always drain it: the connection is kept alive
            url = urlsplit(self.path)
            parts = [p for p in url.path.split("/") if p]
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if parts[:2] == ["__lfs", "upload"] and len(parts) == 3:  # "storage": a ticket, like a signed URL
                return self._lfs_upload(parts[2], query.get("ticket", ""))
            if parts == ["__lfs", "verify"]:
                return self._lfs_verify(self._json())
            user, role = self._user()
            if parts and parts[0] == "api":
                return self._api(parts[1:], query, user, role)
            rtype = "dataset" if parts[:1] == ["datasets"] else "model"
            parts = parts[1:] if rtype == "dataset" else parts
            if len(parts) >= 5 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
                return self._lfs_batch(rtype, f"{parts[0]}/{parts[1][:-4]}", self._json(), user, role)
            if len(parts) >= 5 and parts[2] == "resolve":
                path = unquote("/".join(parts[4:]))
                return self._resolve(rtype, f"{parts[0]}/{parts[1]}", unquote(parts[3]), path, user)
            raise HubError(404, f"Not found: {url.path}")
        except HubError as err:
            headers = {"X-Error-Message": err.message, **({"X-Error-Code": err.code} if err.code else {})}
            self._send(err.status, {"error": err.message}, headers)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = _dispatch

    # -- /api ---------------------------------------------------------------------------------------
    def _api(self, parts: list[str], query: dict, user: str | None, role: str | None) -> None:
        store, method = self.store, self.command
        if parts == ["whoami-v2"]:
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            orgs = [{"name": o, "type": "org"} for o, members in store.orgs.items() if user in members]
            auth = {"type": "access_token", "accessToken": {"displayName": "test", "role": role}}
            return self._send(200, {"type": "user", "name": user, "fullname": user, "orgs": orgs, "auth": auth})
        if parts == ["validate-yaml"]:
            try:
                front_matter(self._json().get("content", ""))
            except ValueError as exc:
                return self._send(400, {"errors": [{"message": str(exc)}], "warnings": []})
            return self._send(200, {"errors": [], "warnings": []})
        if parts[:1] == ["repos"] and parts[1:] in (["create"], ["delete"]):
            body = self._json()
            rtype = body.get("type") or "model"
            namespace = body.get("organization") or user
            repo_id = f"{namespace}/{body.get('name')}"
            if user is None:
                raise HubError(401, "You must be authenticated to do this")
            if not store.can_write(user, role, namespace):
                raise HubError(403, f"You don't have the rights to create a {rtype} under the namespace {namespace!r}")
            with store.lock:
                exists = (rtype, repo_id) in store.repos
                if parts[1] == "delete":
                    if not exists:
                        raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
                    del store.repos[(rtype, repo_id)]
                    return self._send(200, {})
                url = f"{self.base}/{'' if rtype == 'model' else rtype + 's/'}{repo_id}"
                if exists:
                    return self._send(409, {"error": f"You already created this {rtype} repo", "url": url},
                                      {"X-Error-Message": f"You already created this {rtype} repo"})
                private = body.get("private") or body.get("visibility") == "private"
                store.create(rtype, repo_id, bool(private))
            return self._send(200, {"url": url, "name": repo_id, "id": hashlib.sha1(repo_id.encode()).hexdigest()[:24]})
        if len(parts) < 3 or parts[0] not in ("models", "datasets", "spaces"):
            raise HubError(404, f"Not found: /api/{'/'.join(parts)}")
        rtype, repo_id, rest = parts[0][:-1], f"{parts[1]}/{parts[2]}", [unquote(p) for p in parts[3:]]
        write = method in ("POST", "DELETE") and rest[:1] in (["commit"], ["preupload"], ["branch"])
        with store.lock:
            repo = store.repo(rtype, repo_id, user, role, write=write)
            if not rest or rest[0] == "revision":
                return self._info(rtype, repo_id, repo, store.resolve(repo, rest[1] if rest else "main"), query)
            if rest[0] == "tree":
                return self._tree(repo, store.resolve(repo, rest[1]), "/".join(rest[2:]), query)
            if rest[0] == "refs":
                branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s}
                            for b, s in repo["branches"].items()]
                return self._send(200, {"branches": branches, "converts": [], "tags": [], "pullRequests": []})
            if rest[0] == "commits":
                sha, out = store.resolve(repo, rest[1]), []
                while sha:
                    c = repo["commits"][sha]
                    out.append({"id": sha, "title": c["title"], "message": c["message"], "date": c["date"],
                                "authors": [{"user": c.get("author", "system"), "avatar": None}]})
                    sha = c["parent"]
                return self._send(200, out)
            if rest[0] == "branch" and len(rest) == 2:
                body = self._json()
                if method == "DELETE":
                    if rest[1] not in repo["branches"] or rest[1] == "main":
                        raise HubError(404 if rest[1] != "main" else 400, f"Cannot delete branch {rest[1]}")
                    del repo["branches"][rest[1]]
                    return self._send(200, {})
                if rest[1] in repo["branches"]:
                    raise HubError(409, f"Reference refs/heads/{rest[1]} already exists")
                repo["branches"][rest[1]] = store.resolve(repo, body.get("startingPoint") or "main")
                return self._send(200, {})
            if rest[0] == "preupload" and method == "POST":
                return self._preupload(repo, store.resolve(repo, rest[1]), self._json())
            if rest[0] == "commit" and method == "POST":
                if query.get("create_pr"):
                    raise HubError(400, "pull requests are not supported by the test hub")
                lines = [json.loads(line) for line in self.body.splitlines() if line.strip()]
                sha = store.commit(repo, rest[1], lines, user)
                prefix = "" if rtype == "model" else f"{rtype}s/"
                return self._send(200, {"success": True, "commitOid": sha, "pullRequestUrl": None,
                                        "commitUrl": f"{self.base}/{prefix}{repo_id}/commit/{sha}", "hookOutput": ""})
        raise HubError(404, f"Not found: /api/{'/'.join(parts)}")

    def _card_data(self, repo: dict, sha: str) -> dict:
        entry = repo["commits"][sha]["files"].get("README.md")
        if entry is None:
            return {}
        try:
            return front_matter(self.store.blob_path(entry["sha256"]).read_text(errors="replace")) or {}
        except ValueError:
            return {}

    def _info(self, rtype: str, repo_id: str, repo: dict, sha: str, query: dict) -> None:
        commit, blobs = repo["commits"][sha], bool(query.get("blobs"))
        siblings = []
        for path, e in sorted(commit["files"].items()):
            sibling = {"rfilename": path}
            if blobs:
                sibling.update(size=e["size"], blobId=e["blob_id"])
                if e["lfs"]:
                    sibling["lfs"] = lfs_info(e, "sha256")
            siblings.append(sibling)
        card = self._card_data(repo, sha)
        info = {"_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "author": repo_id.split("/")[0],
                "sha": sha, "lastModified": commit["date"], "createdAt": repo["created"], "private": repo["private"],
                "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": list(card.get("tags") or []),
                "siblings": siblings, "spaces": []}
        if rtype == "model":
            info.update(modelId=repo_id, library_name=card.get("library_name"))
        if card:
            info["cardData"] = card
        self._send(200, info)

    def _tree(self, repo: dict, sha: str, path: str, query: dict) -> None:
        files, prefix = repo["commits"][sha]["files"], (path.strip("/") + "/") if path.strip("/") else ""
        recursive = str(query.get("recursive", "")).lower() in ("1", "true")
        entries, dirs = [], set()
        for p, e in sorted(files.items()):
            if not p.startswith(prefix):
                continue
            tail = p[len(prefix):].split("/")
            for i in range(1, len(tail) if recursive else min(2, len(tail))):
                dirs.add(prefix + "/".join(tail[:i]))
            if recursive or len(tail) == 1:
                entry = {"type": "file", "oid": e["blob_id"], "size": e["size"], "path": p}
                if e["lfs"]:
                    entry["lfs"] = lfs_info(e)
                entries.append(entry)
        if prefix and not entries and not dirs:
            raise HubError(404, f"{path} does not exist on this revision", "EntryNotFound")
        folders = [{"type": "directory", "oid": hashlib.sha1((d + sha).encode()).hexdigest(), "size": 0, "path": d}
                   for d in sorted(dirs)]
        self._send(200, folders + entries)

    def _preupload(self, repo: dict, sha: str, body: dict) -> None:
        files = repo["commits"][sha]["files"]
        out = []
        for f in body.get("files", []):
            sample = base64.b64decode(f.get("sample", ""))
            lfs = f["path"].endswith(LFS_SUFFIXES) or f.get("size", 0) >= LFS_MIN_SIZE or b"\0" in sample
            existing = files.get(f["path"])
            oid = None if existing is None else (existing["sha256"] if existing["lfs"] else existing["blob_id"])
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False,
                        "oid": oid})
        self._send(200, {"files": out, "commitOid": sha})

    # -- LFS ------------------------------------------------------------------------------------------
    def _lfs_batch(self, rtype: str, repo_id: str, body: dict, user: str | None, role: str | None) -> None:
        with self.store.lock:
            self.store.repo(rtype, repo_id, user, role, write=body.get("operation") == "upload")
            objects = []
            for obj in body.get("objects", []):
                oid, size = obj["oid"], int(obj["size"])
                item = {"oid": oid, "size": size, "authenticated": True}
                if not self.store.blob_path(oid).exists():
                    ticket = secrets.token_urlsafe(16)
                    self.store.tickets[ticket] = (oid, size)
                    upload = f"{self.base}/__lfs/upload/{oid}?ticket={ticket}"
                    item["actions"] = {"upload": {"href": upload, "header": {}},
                                       "verify": {"href": f"{self.base}/__lfs/verify", "header": {}}}
                objects.append(item)
        self._send(200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"})

    def _lfs_upload(self, oid: str, ticket: str) -> None:
        data = self.body
        expected = self.store.tickets.pop(ticket, None)
        if self.command != "PUT" or expected is None or expected[0] != oid:
            raise HubError(403, "invalid or expired upload ticket")
        if len(data) != expected[1] or hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, f"uploaded content does not match oid {oid} / size {expected[1]}")
        self.store.put_bytes(data)
        self._send(200, None, {"ETag": f'"{oid}"'})

    def _lfs_verify(self, body: dict) -> None:
        time.sleep(self.verify_delay)  # a window between an LFS upload and its commit (to SIGKILL a client in)
        path = self.store.blob_path(body.get("oid", "-"))
        if not path.exists() or path.stat().st_size != body.get("size"):
            raise HubError(404, f"object {body.get('oid')} not found or wrong size")
        self._send(200, {})

    # -- resolve ------------------------------------------------------------------------------------
    def _resolve(self, rtype: str, repo_id: str, rev: str, path: str, user: str | None) -> None:
        with self.store.lock:
            repo = self.store.repo(rtype, repo_id, user)
            sha = self.store.resolve(repo, rev)
            entry = repo["commits"][sha]["files"].get(path)
        if entry is None:
            headers = {"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found", "X-Repo-Commit": sha}
            return self._send(404, {"error": f"Entry not found: {path}"}, headers)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{entry["sha256"] if entry["lfs"] else entry["blob_id"]}"',
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if entry["lfs"]:
            headers.update({"X-Linked-Etag": f'"{entry["sha256"]}"', "X-Linked-Size": entry["size"]})
        data = b"" if self.command == "HEAD" else self.store.blob_path(entry["sha256"]).read_bytes()
        start = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
        if start and self.command != "HEAD" and int(start.group(1)) > 0:
            first = int(start.group(1))
            headers["Content-Range"] = f"bytes {first}-{entry['size'] - 1}/{entry['size']}"
            return self._send(206, raw=data[first:], headers=headers)
        self._send(200, raw=data, headers=headers, length=entry["size"])  # HEAD: the size, no body


def serve(root: Path, port: int, tokens: dict, orgs: dict, verify_delay: float = 0.0) -> None:
    """Blocking: print `READY <url>` once listening, serve until SIGTERM."""
    handler = type("BoundHandler", (Handler,), {"store": Store(root, tokens, orgs), "verify_delay": verify_delay})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    parent = os.getppid()

    def orphan_watch() -> None:  # a killed test run must not leave a server behind
        while os.getppid() == parent:
            time.sleep(1)
        server.shutdown()

    threading.Thread(target=orphan_watch, daemon=True).start()
    print(f"READY http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


class HubServer:
    """Start the server as a subprocess on a free loopback port; `stop()` ends it by pid."""

    def __init__(self, root: str | os.PathLike, tokens: dict[str, str] | None = None,
                 orgs: dict[str, list[str]] | None = None, verify_delay: float = 0.0):
        self.root, self.verify_delay = Path(root), verify_delay
        self.tokens = tokens if tokens is not None else {"hf_test_write_token": "tester:write"}
        self.orgs = orgs or {}
        self.url: str | None = None
        self.pid: int | None = None
        self._proc: subprocess.Popen | None = None

    def start(self) -> HubServer:
        # as a module of the tests package (its storage is a sibling module), run from the repository root
        cmd = [sys.executable, "-m", "tests.helpers.hub_server", "--root", str(self.root.resolve()), "--port", "0"]
        cmd += [a for tok, spec in self.tokens.items() for a in ("--token", f"{tok}:{spec}")]
        cmd += [a for org, users in self.orgs.items() for a in ("--org", f"{org}:{','.join(users)}")]
        cmd += ["--verify-delay", str(self.verify_delay)]
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.root / "server.log"  # a file, not a pipe: an unread pipe would block the server
        with open(log, "w") as err:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO_ROOT)
        self.pid = self._proc.pid
        line = self._proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"hub server did not start: {line!r}\n{log.read_text()[-2000:]}")
        self.url = line.split(" ", 1)[1]
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None

    def client_env(self, token: str | None = None) -> dict[str, str]:
        """Environment for a subprocess whose huggingface_hub should talk to this server."""
        env = {**os.environ, "HF_ENDPOINT": self.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
               "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        env.pop("TRANSFORMERS_OFFLINE", None)
        if token is not None:
            env["HF_TOKEN"] = token
        return env

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def client_pointed_at(url: str, cache_dir: str | os.PathLike | None = None):
    """Point an already-imported huggingface_hub (and transformers) at `url`, undo on exit.

    huggingface_hub copies HF_ENDPOINT into module constants, the module-level `HfApi` and the URL
    template at import time, and transformers caches its own `HfApi`; all of those are swapped here.
    """
    from huggingface_hub import constants, hf_api
    from huggingface_hub.utils import _http

    saved = {k: getattr(constants, k) for k in ("ENDPOINT", "HUGGINGFACE_CO_URL_TEMPLATE", "HF_HUB_OFFLINE",
                                                "HF_HUB_DISABLE_XET", "HF_HUB_CACHE")}
    saved_api, saved_origins = hf_api.api.endpoint, _http._HUB_ORIGINS
    saved_env = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_HUB_DISABLE_XET")}
    constants.ENDPOINT, constants.HF_HUB_OFFLINE, constants.HF_HUB_DISABLE_XET = url, False, True
    constants.HUGGINGFACE_CO_URL_TEMPLATE = url + "/{repo_id}/resolve/{revision}/{filename}"
    if cache_dir is not None:
        constants.HF_HUB_CACHE = str(cache_dir)
    hf_api.api.endpoint = url
    _http._HUB_ORIGINS = saved_origins | {_http._url_origin(url)}
    os.environ.update(HF_ENDPOINT=url, HF_HUB_OFFLINE="0", HF_HUB_DISABLE_XET="1")
    tf_hub = sys.modules.get("transformers.utils.hub")
    saved_tf = getattr(tf_hub, "_hf_api", None)
    if tf_hub is not None:
        tf_hub._hf_api = None
    try:
        yield url
    finally:
        for key, value in saved.items():
            setattr(constants, key, value)
        hf_api.api.endpoint, _http._HUB_ORIGINS = saved_api, saved_origins
        for key, value in saved_env.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        if tf_hub is not None:
            tf_hub._hf_api = saved_tf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="storage directory")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", action="append", default=[], help="TOKEN:USER[:read|write] (default write)")
    parser.add_argument("--org", action="append", default=[], help="ORG:USER[,USER...]")
    parser.add_argument("--verify-delay", type=float, default=0.0, help="seconds before answering an LFS verify")
    args = parser.parse_args(argv)
    tokens = {}
    for spec in args.token:
        token, user, *role = spec.split(":")
        tokens[token] = (user, role[0] if role else "write")
    orgs = {org: set(users.split(",")) for org, users in (s.split(":", 1) for s in args.org)}
    serve(Path(args.root), args.port, tokens, orgs, args.verify_delay)


if __name__ == "__main__":
    main()
