"""State behind the test hub (tests/support/hub_server.py): repos, commits, LFS objects, faults.

Kept apart from the HTTP layer so tests can inspect what the hub holds (commits, privacy,
stored objects) without going through the protocol.
"""

from __future__ import annotations

import base64
import hashlib
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

GITATTRIBUTES = b"*.pt filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"
LFS_SUFFIXES = (".pt", ".bin", ".safetensors", ".npy")
LFS_MIN_SIZE = 10 << 20  # the Hub sends files above 10 MB through LFS whatever their type


def git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hub_date(ts: float) -> str:
    """Timestamp in the Hub's JSON format: 2024-01-02T03:04:05.678Z."""
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class HubRefusal(Exception):
    """A request the hub answers with an error status (not a fault: a protocol answer)."""

    def __init__(self, status: int, message: str, error_code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_code = status, message, error_code


@dataclass(frozen=True)
class Blob:
    size: int
    oid: str  # git object id (sha1): of the content, or of the LFS pointer
    sha256: str | None = None  # set for LFS files; the content lives in the object store
    content: bytes | None = None  # set for regular files


@dataclass
class Commit:
    oid: str
    parent: str | None
    title: str
    message: str
    date: float
    tree: dict[str, Blob]


@dataclass
class Repo:
    repo_id: str
    repo_type: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    # LFS objects the repo holds (its storage): sha256 -> (a path that named it, pushed at).
    # Objects are shared on disk; a repo's permanent deletion drops its ownership, and the
    # bytes go when no repo owns them.
    lfs: dict[str, tuple[str, float]] = field(default_factory=dict)

    def resolve(self, rev: str) -> Commit:
        if rev in self.branches:
            return self.commits[self.branches[rev]]
        found = [c for oid, c in self.commits.items() if len(rev) >= 7 and oid.startswith(rev)]
        if len(found) != 1:
            raise HubRefusal(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return found[0]

    def log(self, rev: str) -> list[Commit]:
        out, commit = [], self.resolve(rev)
        while commit is not None:
            out.append(commit)
            commit = self.commits.get(commit.parent) if commit.parent else None
        return out


class HubState:
    """Repos keyed by (repo_type, repo_id); LFS objects as files under `root` (by sha256)."""

    def __init__(self, root: Path):
        self.root = root
        (root / "lfs").mkdir(parents=True, exist_ok=True)
        (root / "incoming").mkdir(exist_ok=True)
        self.repos: dict[tuple[str, str], Repo] = {}
        self.lock = threading.RLock()
        self._counter = 0

    def repo(self, repo_type: str, repo_id: str) -> Repo:
        with self.lock:
            repo = self.repos.get((repo_type, repo_id))
        if repo is None:
            raise HubRefusal(404, "Repository not found", "RepoNotFound")
        return repo

    def create_repo(self, repo_type: str, repo_id: str, private: bool) -> bool:
        with self.lock:
            if (repo_type, repo_id) in self.repos:
                return False
            repo = Repo(repo_id, repo_type, private)
            self.repos[(repo_type, repo_id)] = repo
            blob = Blob(len(GITATTRIBUTES), git_oid(GITATTRIBUTES), content=GITATTRIBUTES)
            self._add_commit(repo, "main", None, "initial commit", "", {".gitattributes": blob})
            return True

    def lfs_path(self, sha256: str) -> Path:
        return self.root / "lfs" / sha256

    def has_lfs(self, sha256: str, size: int | None = None) -> bool:
        path = self.lfs_path(sha256)
        return path.is_file() and (size is None or path.stat().st_size == size)

    def delete_lfs(self, repo: Repo, shas: list[str]) -> None:
        """`permanently_delete_lfs_files(rewrite_history=False)`: the repo no longer holds
        these objects; commits that name them stay, and their downloads fail."""
        with self.lock:
            for sha in shas:
                if repo.lfs.pop(sha, None) is None:
                    raise HubRefusal(404, f"LFS object {sha} not found in {repo.repo_id}")
                if not any(sha in other.lfs for other in self.repos.values()):
                    self.lfs_path(sha).unlink(missing_ok=True)

    def upload_mode(self, path: str, size: int, sample: bytes) -> str:
        if size >= LFS_MIN_SIZE or path.endswith(LFS_SUFFIXES) or b"\0" in sample:
            return "lfs"
        return "regular"

    def commit(
        self, repo: Repo, branch: str, parent: str | None, title: str, message: str, ops: list[dict]
    ) -> Commit:
        with self.lock:
            if branch not in repo.branches:
                raise HubRefusal(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            head = repo.branches[branch]
            if parent is not None and not head.startswith(parent):
                raise HubRefusal(412, "A commit has happened since. Please refresh and try again.")
            tree = dict(repo.commits[head].tree)
            for op in ops:
                self._apply(tree, op)
                if op["key"] == "lfsFile":
                    repo.lfs.setdefault(op["value"]["oid"], (op["value"]["path"], time.time()))
            return self._add_commit(repo, branch, head, title, message, tree)

    def _apply(self, tree: dict[str, Blob], op: dict) -> None:
        key, value = op["key"], op["value"]
        path = value["path"]
        if key == "file":
            data = base64.b64decode(value["content"])
            tree[path] = Blob(len(data), git_oid(data), content=data)
        elif key == "lfsFile":
            sha = value["oid"]
            if not self.has_lfs(sha, value.get("size")):
                raise HubRefusal(422, f"LFS object {sha} for {path} was never uploaded")
            size = self.lfs_path(sha).stat().st_size
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n"
            tree[path] = Blob(size, git_oid(pointer.encode()), sha256=sha)
        elif key == "deletedFile":
            if tree.pop(path, None) is None:
                raise HubRefusal(404, "A file with this name doesn't exist", "EntryNotFound")
        elif key == "deletedFolder":
            for p in [p for p in tree if p.startswith(path.rstrip("/") + "/")]:
                del tree[p]
        else:
            raise HubRefusal(400, f"unknown commit operation {key!r}")

    def _add_commit(
        self, repo: Repo, branch: str, parent: str | None, title: str, message: str, tree: dict
    ) -> Commit:
        self._counter += 1
        seed = f"{repo.repo_id}:{parent}:{title}:{time.time_ns()}:{self._counter}".encode()
        commit = Commit(hashlib.sha1(seed).hexdigest(), parent, title, message, time.time(), tree)
        repo.commits[commit.oid] = commit
        repo.branches[branch] = commit.oid
        return commit


# -- fault injection ---------------------------------------------------------------------
FAULT_KINDS = ("status", "drop", "drop_after", "status_after", "slow", "truncate", "corrupt",
               "call")


@dataclass
class Fault:
    """Applied to the next `count` requests of `route` (optionally only for `method`).

    kinds: status (answer `status` with an error body and `headers`), drop (close the
    connection without answering), drop_after (do the work, then close without answering:
    the answer is lost), status_after (do the work, then answer `status`: a gateway timing
    out a commit that landed), slow (sleep `delay` seconds first), truncate (send the
    announced length's first half, then close), corrupt (flip bytes of a download, same
    length), call (run `fn()` first).
    `path_contains` narrows the fault to request paths containing that text.
    """

    route: str
    kind: str
    count: int = 1
    method: str | None = None
    path_contains: str | None = None
    status: int = 500
    delay: float = 0.0
    fn: Callable[[], None] | None = None
    headers: dict | None = None     # of a `status` answer (Retry-After, RateLimit)
    hits: int = 0


class RateLimits:
    """Per-route quotas of the test hub: `limit` requests (of `method`, default all) per fixed
    window of `window_s` seconds; past it a 429 naming the window's end, as the Hub names it
    (`Retry-After` in whole seconds, rounded up; `RateLimit: "api";r=0;t=N`). A request that
    arrives before the Retry-After of the 429 it follows is counted in `early`."""

    def __init__(self) -> None:
        self._limits: dict[str, dict] = {}
        self._lock = threading.Lock()
        self.early = 0          # requests sent before the Retry-After of their route's 429
        self.answered_429 = 0

    def set(self, route: str, limit: int, window_s: float, method: str | None = None) -> None:
        with self._lock:
            self._limits[route] = {"limit": limit, "window_s": window_s, "method": method,
                                   "start": time.monotonic(), "used": 0, "retry_at": 0.0}

    def take(self, route: str, method: str) -> dict | None:
        """The 429's headers when this request is over its route's quota, else None."""
        with self._lock:
            quota = self._limits.get(route)
            if quota is None or quota["method"] not in (None, method):
                return None
            now = time.monotonic()
            if now < quota["retry_at"]:
                self.early += 1
            if now - quota["start"] >= quota["window_s"]:
                quota["start"], quota["used"] = now, 0
            quota["used"] += 1
            if quota["used"] <= quota["limit"]:
                return None
            left = quota["window_s"] - (now - quota["start"])
            seconds = max(1, math.ceil(left))
            quota["retry_at"] = now + left
            self.answered_429 += 1
            return {"Retry-After": str(seconds), "RateLimit": f'"api";r=0;t={seconds}',
                    "RateLimit-Policy": f'"fixed window";"api";q={quota["limit"]};'
                                        f'w={math.ceil(quota["window_s"])}'}


class Faults:
    def __init__(self) -> None:
        self._faults: list[Fault] = []
        self._lock = threading.Lock()

    def add(self, route: str, kind: str, count: int = 1, **kwargs) -> Fault:
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}")
        fault = Fault(route, kind, count, **kwargs)
        with self._lock:
            self._faults.append(fault)
        return fault

    def take(self, route: str, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if (
                    fault.route == route
                    and fault.method in (None, method)
                    and (fault.path_contains is None or fault.path_contains in path)
                    and fault.hits < fault.count
                ):
                    fault.hits += 1
                    return fault
        return None

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
