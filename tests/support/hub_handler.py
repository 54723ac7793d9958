"""HTTP side of the test hub: routes of the Hub protocol subset, fault injection, recording.

See tests/support/hub_server.py for the list of routes and how to run the hub.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Iterator
from urllib.parse import parse_qs, unquote, urlsplit

from .hub_lfs_files import LFS_FILES_ROUTES, LfsFilesRoutes
from .hub_repo import Blob, Commit, Fault, HubRefusal, hub_date

if TYPE_CHECKING:
    from .hub_server import HubServer

CHUNK = 1 << 20
UPLOAD_CHUNK = 4 << 20
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_API = r"^/api/(?P<type>models|datasets)/" + _REPO
_GIT = r"^/(?:(?P<type>datasets)/)?" + _REPO
ROUTES = [  # (methods, pattern, route name); first match wins
    ({"POST"}, r"^/api/repos/create$", "create"),
    ({"POST"}, _API + r"/preupload/(?P<rev>[^/]+)$", "preupload"),
    ({"POST"}, _API + r"/commit/(?P<rev>[^/]+)$", "commit"),
    ({"GET"}, _API + r"/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$", "tree"),
    ({"GET"}, _API + r"/commits/(?P<rev>[^/]+)$", "commits"),
    ({"GET"}, _API + r"/xet-(?:read|write)-token/.*$", "xet"),
    *[(methods, _API + tail, name) for methods, tail, name in LFS_FILES_ROUTES],
    ({"GET"}, _API + r"(?:/revision/(?P<rev>[^/]+))?$", "repo_info"),
    ({"POST"}, _GIT + r"\.git/info/lfs/objects/batch$", "lfs_batch"),
    ({"PUT"}, r"^/_lfs/(?P<oid>[0-9a-f]{64})$", "lfs_upload"),
    ({"POST"}, r"^/_lfs/(?P<oid>[0-9a-f]{64})/verify$", "lfs_verify"),
    ({"GET", "HEAD"}, _GIT + r"/resolve/(?P<rev>[^/]+)/(?P<path>.+)$", "resolve"),
]
_COMPILED = [(methods, re.compile(pattern), name) for methods, pattern, name in ROUTES]
WRITE_ROUTES = {"create", "preupload", "commit", "lfs_batch", "lfs_verify", "lfs_delete"}


@dataclass(frozen=True)
class Request:
    method: str
    route: str
    path: str
    range: str | None
    authenticated: bool


class HubHandler(LfsFilesRoutes, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # A response is two writes (headers, then body): with Nagle's algorithm on, the body
    # waits for the client's delayed ACK of the headers, ~40 ms per request on loopback that
    # no real Hub adds (measured on the retention step's one deletion call).
    disable_nagle_algorithm = True

    def log_message(self, format, *args):  # noqa: A002 - the stdlib signature
        pass  # requests are recorded in HubServer.requests instead of printed

    def do_GET(self):
        self._dispatch()

    do_HEAD = do_POST = do_PUT = do_GET

    # -- plumbing ------------------------------------------------------------------------
    @property
    def hub(self) -> "HubServer":
        return self.server.hub  # type: ignore[attr-defined]

    def _dispatch(self) -> None:
        self._body: bytes | None = None  # one handler serves many requests on a kept-alive socket
        split = urlsplit(self.path)
        for methods, pattern, name in _COMPILED:
            match = pattern.match(split.path)
            if match and self.command in methods:
                break
        else:
            self._drain()
            return self._json(404, {"error": f"no route for {self.command} {split.path}"})
        args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
        args["type"] = {"models": "model", "datasets": "dataset"}.get(args.get("type", "models"), "model")
        query = {k: v[-1] for k, v in parse_qs(split.query).items()}
        authed = self.hub.token is None or self.headers.get("Authorization") == f"Bearer {self.hub.token}"
        self.hub._record(Request(self.command, name, split.path, self.headers.get("Range"), authed))
        limited = self.hub.rate_limits.take(name, self.command)
        if limited is not None:          # over the route's quota: 429 with the Hub's headers
            self._drain()
            return self._json(429, {"error": "rate limited"}, limited)
        fault = self.hub.faults.take(name, self.command, split.path)
        if fault is not None and fault.kind in ("status", "drop"):
            self._drain()
            if fault.kind == "drop":
                self.close_connection = True
                return
            return self._json(fault.status, {"error": f"injected {fault.status}"}, fault.headers)
        if fault is not None and fault.kind == "slow":
            time.sleep(fault.delay)
        if fault is not None and fault.kind == "call":
            fault.fn()
        try:
            if name in WRITE_ROUTES and not authed:
                raise HubRefusal(401, "Invalid credentials in Authorization header")
            getattr(self, f"_{name}")(args, query, authed, fault)
        except HubRefusal as refusal:
            self._drain()
            headers = {"X-Error-Code": refusal.error_code} if refusal.error_code else {}
            self._json(refusal.status, {"error": refusal.message}, headers, fault)
        except (ConnectionError, TimeoutError):
            self.close_connection = True  # the client went away mid-request
        except Exception as exc:  # a bug in the test hub: answer like a broken server would
            self.close_connection = True
            self._json(500, {"error": f"test hub bug: {type(exc).__name__}: {exc}"})

    def _drain(self) -> bytes:
        """Read the request body once (Content-Length or chunked); later calls return it again."""
        if self._body is not None:
            return self._body
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self._body = b"".join(self._chunks())
        else:
            self._body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return self._body

    def _chunks(self) -> Iterator[bytes]:
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                self.rfile.readline()
                return
            yield self.rfile.read(size)
            self.rfile.readline()

    def _json(self, status: int, obj, headers: dict | None = None, fault: Fault | None = None) -> None:
        if fault is not None and fault.kind == "drop_after":
            self.close_connection = True  # the work is done, the answer is lost
            return
        if fault is not None and fault.kind == "status_after":  # done, answered as failed
            status, obj, headers = fault.status, {"error": f"injected {fault.status}"}, fault.headers
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _readable_repo(self, args: dict, authed: bool):
        repo = self.hub.state.repo(args["type"], args["repo"])
        if repo.private and not authed:
            raise HubRefusal(401, "Invalid username or password.", "RepoNotFound")
        return repo

    # -- routes --------------------------------------------------------------------------
    def _create(self, args, query, authed, fault):
        payload = json.loads(self._drain())
        repo_id = f"{payload['organization']}/{payload['name']}"
        private = payload.get("visibility") == "private" or bool(payload.get("private"))
        created = self.hub.state.create_repo(payload.get("type") or "model", repo_id, private)
        url = f"{self.hub.url}/{repo_id}"
        if not created:  # the Hub's 409 still names the repo's url (create_repo(exist_ok) reads it)
            return self._json(409, {"error": "You already created this model repo", "url": url}, fault=fault)
        self._json(200, {"url": url, "name": repo_id}, fault=fault)

    def _repo_info(self, args, query, authed, fault):
        repo = self._readable_repo(args, authed)
        commit = repo.resolve(args.get("rev", "main"))
        first = repo.log("main")[-1]
        self._json(200, {
            "id": repo.repo_id, "sha": commit.oid, "private": repo.private,
            "siblings": [{"rfilename": p} for p in sorted(commit.tree)],
            "lastModified": hub_date(commit.date), "createdAt": hub_date(first.date),
            "disabled": False, "gated": False, "tags": [],
        }, fault=fault)

    def _preupload(self, args, query, authed, fault):
        repo = self._readable_repo(args, authed)
        commit = repo.resolve(args["rev"])
        files = []
        for f in json.loads(self._drain())["files"]:
            mode = self.hub.state.upload_mode(f["path"], f["size"], base64.b64decode(f["sample"]))
            entry = {"path": f["path"], "uploadMode": mode, "shouldIgnore": False}
            existing = commit.tree.get(f["path"])
            if existing is not None:
                entry["oid"] = existing.sha256 if mode == "lfs" else existing.oid
            files.append(entry)
        self._json(200, {"files": files, "commitOid": commit.oid}, fault=fault)

    def _lfs_batch(self, args, query, authed, fault):
        self._readable_repo(args, authed)
        objects = []
        for obj in json.loads(self._drain())["objects"]:
            oid, size = obj["oid"], obj["size"]
            out = {"oid": oid, "size": size, "authenticated": True}
            if not self.hub.state.has_lfs(oid, size):
                out["actions"] = {
                    "upload": {"href": f"{self.hub.url}/_lfs/{oid}", "expires_in": 3600},
                    "verify": {"href": f"{self.hub.url}/_lfs/{oid}/verify", "expires_in": 3600},
                }
            objects.append(out)
        self._json(200, {"transfer": "basic", "objects": objects}, fault=fault)

    def _lfs_upload(self, args, query, authed, fault):
        oid = args["oid"]
        tmp = self.hub.state.root / "incoming" / uuid.uuid4().hex
        try:
            with open(tmp, "wb") as f:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    digest = hashlib.sha256()
                    for chunk in self._chunks():
                        digest.update(chunk)
                        f.write(chunk)
                else:
                    digest = self._receive_into(f, int(self.headers.get("Content-Length") or 0))
            self._body = b""
            if digest.hexdigest() != oid:
                raise HubRefusal(400, f"uploaded bytes have sha256 {digest.hexdigest()}, not {oid}")
            os.replace(tmp, self.hub.state.lfs_path(oid))
        finally:
            tmp.unlink(missing_ok=True)
        self._json(200, {}, fault=fault)

    def _receive_into(self, f, left: int):
        """Copy `left` body bytes to `f`, hashing them on a second thread (hashlib drops the GIL)."""
        digest = hashlib.sha256()
        pending: queue.Queue = queue.Queue(maxsize=8)

        def hash_worker() -> None:
            while (chunk := pending.get()) is not None:
                digest.update(chunk)

        worker = threading.Thread(target=hash_worker, daemon=True)
        worker.start()
        try:
            while left > 0:
                chunk = self.rfile.read(min(UPLOAD_CHUNK, left))
                if not chunk:
                    raise ConnectionError("client hung up mid-upload")
                left -= len(chunk)
                pending.put(chunk)
                f.write(chunk)
        finally:
            pending.put(None)
            worker.join()
        return digest

    def _lfs_verify(self, args, query, authed, fault):
        body = json.loads(self._drain())
        if not self.hub.state.has_lfs(args["oid"], body.get("size")):
            raise HubRefusal(404, f"LFS object {args['oid']} not found")
        self._json(200, {"success": True}, fault=fault)

    def _commit(self, args, query, authed, fault):
        repo = self._readable_repo(args, authed)
        lines = [json.loads(line) for line in self._drain().splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            raise HubRefusal(400, "commit payload must start with a header line")
        header = lines[0]["value"]
        commit = self.hub.state.commit(
            repo, args["rev"], header.get("parentCommit"), header["summary"],
            header.get("description", ""), lines[1:],
        )
        url = f"{self.hub.url}/{repo.repo_id}/commit/{commit.oid}"
        self._json(200, {"success": True, "commitOid": commit.oid, "commitUrl": url}, fault=fault)

    def _commits(self, args, query, authed, fault):
        repo = self._readable_repo(args, authed)
        self._json(200, [
            {"id": c.oid, "title": c.title, "message": c.message, "date": hub_date(c.date),
             "authors": [{"user": "fractus-test"}]}
            for c in repo.log(args["rev"])
        ], fault=fault)

    def _tree(self, args, query, authed, fault):
        repo = self._readable_repo(args, authed)
        commit = repo.resolve(args["rev"])
        prefix = args.get("path", "").strip("/")
        recursive = query.get("recursive", "false").lower() == "true"
        files, dirs = [], set()
        for path, blob in sorted(commit.tree.items()):
            if prefix and not path.startswith(prefix + "/"):
                continue
            rest = path[len(prefix) + 1:] if prefix else path
            parts = rest.split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                dirs.add("/".join(([prefix] if prefix else []) + parts[:depth]))
            if recursive or len(parts) == 1:
                files.append(_file_entry(path, blob))
        entries = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d}
                   for d in sorted(dirs)]
        self._json(200, entries + files, fault=fault)

    def _xet(self, args, query, authed, fault):
        raise HubRefusal(501, "this test hub speaks plain LFS only: set HF_HUB_DISABLE_XET=1")

    def _resolve(self, args, query, authed, fault):
        repo = self._readable_repo(args, authed)
        commit = repo.resolve(args["rev"])
        blob = commit.tree.get(args["path"])
        if blob is None:
            raise HubRefusal(404, "Entry not found", "EntryNotFound")
        if blob.sha256 and not self.hub.state.has_lfs(blob.sha256):
            raise HubRefusal(404, "the file's LFS object was permanently deleted", "EntryNotFound")
        self._send_blob(blob, commit, fault)

    def _send_blob(self, blob: Blob, commit: Commit, fault: Fault | None) -> None:
        start, end = 0, blob.size - 1
        rng = self.headers.get("Range")
        status = 200
        if rng and self.command == "GET" and blob.size:
            lo, _, hi = rng.removeprefix("bytes=").partition("-")
            start, end, status = int(lo), min(int(hi) if hi else end, end), 206
        length = max(0, end - start + 1)
        self.send_response(status)
        self.send_header("X-Repo-Commit", commit.oid)
        etag = blob.sha256 or blob.oid
        self.send_header("ETag", f'"{etag}"')
        if blob.sha256:
            self.send_header("X-Linked-Etag", f'"{blob.sha256}"')
            self.send_header("X-Linked-Size", str(blob.size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(length))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{blob.size}")
        self.end_headers()
        if self.command == "HEAD" or length == 0:
            return
        kind = fault.kind if fault is not None else None
        if kind == "truncate":
            length //= 2
            self.close_connection = True
        if blob.content is not None:
            data = blob.content[start:start + length]
            self.wfile.write(_flip(data) if kind == "corrupt" else data)
            return
        with open(self.hub.state.lfs_path(blob.sha256), "rb") as f:
            if kind != "corrupt":
                self.connection.sendfile(f, offset=start, count=length)
                return
            f.seek(start)
            left = length
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                left -= len(chunk)
                self.wfile.write(_flip(chunk))


def _flip(data: bytes) -> bytes:
    return bytes([data[0] ^ 0xFF]) + data[1:] if data else data


def _file_entry(path: str, blob: Blob) -> dict:
    entry = {"type": "file", "oid": blob.oid, "size": blob.size, "path": path}
    if blob.sha256:
        entry["lfs"] = {"oid": blob.sha256, "size": blob.size, "pointerSize": 134}
    return entry
