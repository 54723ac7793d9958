"""file:// backend: an embedded, content-addressed store on local disk.

Layout under the store root:

    objects/ab/ab12...      file contents, named by their sha256 (written once, never changed)
    commits/<rev>.json      {"parent", "message", "timestamp", "index"}: index is the hub index
                            (every tracked path -> sha256, size); <rev> = sha256 of the file
    refs/main               the head revision id
    lock                    flock(2) taken while the head moves

A push writes its objects, then its commit record, then swaps `refs/main` under the lock: a
crash at any point leaves the previous head intact. A revision id is the sha256 of its commit
record, so a damaged record is detected on read like a damaged object.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Mapping

from .integrity import (
    HubError,
    IntegrityError,
    PushConflict,
    conflicting_paths,
    decode_index,
    encode_index,
    install_copy,
)
from .store import DropPaths, HistoryEntry, PushFiles, Store, next_index
from launcher.files import FileEntry, atomic_write_bytes, fsync_dir, sha256_stream

BRANCH = "main"
MIN_PREFIX = 7  # shortest revision prefix accepted, as with git short hashes
# The one rule for a relative file:// path (launcher/hub/by_url.py applies it), said where a
# store is not found.
RELATIVE_PATHS = ("a relative file:// path is taken from where it is written: typed on the "
                  "command line, from the current directory; in fractus-pod.yaml, from the "
                  "pod directory")


class FileStore(Store):
    def __init__(self, root: Path, pod_dir: Path):
        super().__init__(pod_dir)
        self.root = Path(root).absolute()
        self.url = f"file://{self.root}"
        # Indexes of commits written here: `files_at` right after a push skips re-hashing.
        self._pushed: dict[str, dict[str, FileEntry]] = {}

    def _reserved_dirs(self) -> list[Path]:
        # A store kept inside the pod (file://hub) must not be overwritten by a pull.
        return [*super()._reserved_dirs(), self.root.resolve()]

    # -- reading -------------------------------------------------------------------------
    def head(self) -> str | None:
        try:
            return (self.root / "refs" / BRANCH).read_text().strip() or None
        except FileNotFoundError:
            return None

    def resolve(self, revision: str | None) -> str:
        if not self.root.is_dir():     # a wrong folder, not an empty store: the user's to fix
            raise HubError(f"no hub store at {self.root}; check the path ({RELATIVE_PATHS})",
                           status=404)
        if revision is None:
            head = self.head()
            if head is None:
                raise HubError(f"{self.url} has no revisions yet; push one first with "
                               f"`fractus-pod sync push`", status=404)
            return head
        if revision == BRANCH:
            return self.resolve(None)
        rev = revision.lower()
        fix = "`fractus-pod sync history` lists them"
        if len(rev) < MIN_PREFIX or any(c not in "0123456789abcdef" for c in rev):
            raise HubError(f"unknown revision {revision!r} in {self.url}; {fix}", status=404)
        found = [p.stem for p in (self.root / "commits").glob(f"{rev}*.json")]
        if len(found) != 1:
            what = "ambiguous" if found else "unknown"
            raise HubError(f"{what} revision {revision!r} in {self.url}; {fix}", status=404)
        return found[0]

    def _record(self, rev: str) -> dict:
        path = self.root / "commits" / f"{rev}.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise HubError(f"unknown revision {rev!r} in {self.url}") from None
        got = hashlib.sha256(data).hexdigest()
        if got != rev:
            raise IntegrityError(f"commit record {rev[:12]} in {self.url} is corrupt; refused")
        return json.loads(data)

    def files_at(self, revision: str) -> dict[str, FileEntry]:
        # A commit this store object wrote: the index it wrote. Every other read (pull,
        # files, read_bytes) still reads the record and checks its hash.
        if revision in self._pushed:
            return dict(self._pushed[revision])
        return super().files_at(revision)

    def _index(self, rev: str) -> dict[str, FileEntry]:
        return decode_index(self._record(rev)["index"].encode(), f"{self.url}@{rev[:12]}")[0]

    def history(self) -> list[HistoryEntry]:
        out: list[HistoryEntry] = []
        rev = self.head()
        while rev is not None:
            rec = self._record(rev)
            out.append(HistoryEntry(rev, rec["message"], datetime.fromisoformat(rec["timestamp"])))
            rev = rec["parent"]
        return out

    def revisions_until(self, known) -> list[str]:
        # Walk parents from the head: a push reads its own new records, not the whole chain.
        out: list[str] = []
        rev = self.head()
        while rev is not None:
            out.append(rev)
            if rev in known:
                break
            rev = self._record(rev)["parent"]
        return out

    def _object(self, sha: str) -> Path:
        return self.root / "objects" / sha[:2] / sha

    def _fetch(self, rel: str, entry: FileEntry, revision: str, dest: Path) -> None:
        obj = self._object(entry.sha256)
        if not obj.is_file():
            raise IntegrityError(f"{rel} at revision {revision[:12]}: object missing from {self.url}")
        install_copy(obj, dest, entry, f"{rel} at revision {revision[:12]}")

    # -- storage -------------------------------------------------------------------------
    def stored_objects(self) -> dict[str, int]:
        out = {}
        try:
            shards = [d for d in os.scandir(self.root / "objects")
                      if d.is_dir() and len(d.name) == 2]
        except FileNotFoundError:
            return out
        for shard in shards:
            for obj in os.scandir(shard.path):
                if obj.is_file():
                    out[obj.name] = obj.stat().st_size
        return out

    def delete_objects(self, shas: list[str]) -> None:
        with self._locked():      # the head cannot move meanwhile: never one it names
            head = self.head()
            named = {e.sha256 for e in self.files_at(head).values()} if head else set()
            doomed = [self._object(sha) for sha in shas if sha not in named]
            # No fsync: a deletion a crash undoes is done again after the next push. In
            # parallel: an unlink waits on the disk (~0.4-4 ms each on a disk mounted with
            # `discard`, whatever the size), and four at once take about as long as one.
            if len(doomed) > 1:
                with ThreadPoolExecutor(min(len(doomed), 8)) as pool:
                    list(pool.map(_unlink, doomed))
            elif doomed:
                _unlink(doomed[0])

    # -- writing -------------------------------------------------------------------------
    def push(self, files: PushFiles, message: str, *, base: str | None = None,
             expected: Mapping[str, str] | None = None, drop: DropPaths | None = None) -> str:
        local = self._local_files(files)
        base = self.head() if base is None else self.resolve(base)
        entries = {rel: self._store_object(path) for rel, path in local.items()}
        self._check_expected(entries, expected)   # the copy was the one read: no commit if off
        with self._locked():
            head = self.head()
            index = self._index(head) if head else {}
            if head != base:
                clash = conflicting_paths(self._index(base) if base else {}, index, entries)
                if clash:
                    raise PushConflict(
                        f"{self.url} moved from {str(base)[:12]} to {head[:12]} and changed "
                        f"{', '.join(clash)}; pull and retry instead of overwriting"
                    )
            index, _dropped = next_index(index, entries, drop)
            record = {
                "parent": head,
                "message": message,
                "timestamp": datetime.now(timezone.utc).isoformat(),
                "index": encode_index(index, uuid.uuid4().hex).decode(),
            }
            data = (json.dumps(record, sort_keys=True) + "\n").encode()
            rev = hashlib.sha256(data).hexdigest()
            atomic_write_bytes(self.root / "commits" / f"{rev}.json", data)
            atomic_write_bytes(self.root / "refs" / BRANCH, f"{rev}\n".encode())
        self._pushed[rev] = index
        self.parents[rev] = head
        return rev

    def _store_object(self, src: Path) -> FileEntry:
        """Copy `src` into the object store (hashing as it copies); dedupe by content."""
        tmp_dir = self.root / "objects" / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = tmp_dir / uuid.uuid4().hex
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                entry = sha256_stream(fin, fout)
                fout.flush()
                os.fsync(fout.fileno())
            obj = self._object(entry.sha256)
            if not obj.is_file():
                obj.parent.mkdir(exist_ok=True)
                os.chmod(tmp, 0o444)  # objects are immutable
                os.replace(tmp, obj)
                fsync_dir(obj.parent)
            return entry
        finally:
            tmp.unlink(missing_ok=True)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
