"""The store interface shared by both backends (the URL picks one: launcher/hub/by_url.py):
each push is one commit of the files plus the hub index (every tracked file's sha256), and a
pull installs only bytes whose sha256 matches the index, all from one resolved commit id."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator, Mapping

from launcher.files import FileEntry, fsync_dir
from launcher.paths import HUB_SCRATCH_DIR
from launcher.pod.progress import progress

from .integrity import (
    INDEX_PATH,
    HubError,
    IntegrityError,
    confine,
    matches,
    pod_relpath,
)

log = logging.getLogger(__name__)

PushFiles = Mapping[str, "str | Path"] | Iterable[str]
# Which paths of the parent's index a push no longer names unless it carries them.
DropPaths = Callable[[str], bool]


@dataclass(frozen=True)
class HistoryEntry:
    revision: str
    message: str
    timestamp: datetime  # timezone-aware, UTC


class Store(ABC):
    """One pod's revisioned file store. Subclasses: `FileStore` (file://), `HfStore` (hf://)."""

    url: str

    def __init__(self, pod_dir: Path):
        self.pod_dir = Path(pod_dir).absolute()
        # revision -> parent of each commit made here: retention learns whether another
        # writer committed in between without listing the history.
        self.parents: dict[str, str | None] = {}

    # -- to implement --------------------------------------------------------------------
    @abstractmethod
    def push(self, files: PushFiles, message: str, *, base: str | None = None,
             expected: Mapping[str, str] | None = None, drop: DropPaths | None = None) -> str:
        """Commit `files` (pod-relative path -> local file, or paths) in ONE revision; return it.

        PushConflict (nothing overwritten) if another writer changed a pushed path since
        `base` (default: the head at the start); other paths' changes are kept. `expected`:
        path -> required sha256; a mismatch raises IntegrityError, nothing committed.
        `drop`: the paths of the head it lands on that `drop(path)` is true of and that this
        push does not carry are no longer named by the new revision (`next_index`); older
        revisions still name them."""

    @abstractmethod
    def head(self) -> str | None:
        """Revision id of the newest commit, or None for an empty or missing store."""

    @abstractmethod
    def history(self) -> list[HistoryEntry]:
        """Commits, newest first."""

    def revisions_until(self, known) -> list[str]:
        """Revision ids newest first, down to and including the first in `known` (else all)."""
        out = []
        for entry in self.history():
            out.append(entry.revision)
            if entry.revision in known:
                break
        return out

    @abstractmethod
    def resolve(self, revision: str | None) -> str:
        """Full commit id for `revision` (None = head); HubError if there is none."""

    @abstractmethod
    def _index(self, revision: str) -> dict[str, FileEntry]:
        """The hub index at a full revision id."""

    @abstractmethod
    def _fetch(self, rel: str, entry: FileEntry, revision: str, dest: Path) -> None:
        """Place the verified bytes of `rel` at `revision` into `dest`, atomically."""

    # -- storage (launcher/hub/retention.py) ---------------------------------------------
    @abstractmethod
    def stored_objects(self) -> dict[str, int]:
        """sha256 -> size of every large object the store holds (what storage costs)."""

    @abstractmethod
    def delete_objects(self, shas: list[str]) -> None:
        """Delete these objects for good; revisions naming them can no longer be pulled."""

    # -- shared behaviour ----------------------------------------------------------------
    def files(self, revision: str | None = None) -> dict[str, FileEntry]:
        """The hub index at `revision` (default head)."""
        if revision is None:
            head = self.head()
            return {} if head is None else self._index(head)
        return self._index(self.resolve(revision))

    def files_at(self, revision: str) -> dict[str, FileEntry]:
        """The hub index at a full revision id, not resolved again (one request fewer)."""
        return self._index(revision)

    def pull(self, paths: Iterable[str] | None = None, revision: str | None = None) -> dict[str, Path]:
        """Download `paths` (default: all tracked) at `revision` (default: head); return
        {pod-relative path: local path} in request order. Files already matching are kept;
        on any mismatch IntegrityError and nothing is installed."""
        rev = self.resolve(revision)
        index = self._index(rev)
        wanted = list(index) if paths is None else [pod_relpath(p) for p in paths]
        missing = [p for p in wanted if p not in index]
        if missing:
            raise HubError(f"not in revision {rev[:12]} of {self.url}: {', '.join(missing)}")
        out: dict[str, Path] = {}
        # All verified in scratch before any is moved in: a refused checkpoint never
        # leaves the manifest installed, naming a file that is not.
        stage = self.pod_dir / HUB_SCRATCH_DIR / f"pull-{uuid.uuid4().hex[:12]}"
        staged: dict[str, Path] = {}
        try:
            with progress(f"hub pull {rev[:12]}", sum(index[rel].size for rel in wanted),
                          "bytes") as task:
                for rel in wanted:
                    task.update(description=f"hub pull {rev[:12]}: {rel}")
                    dest = self._destination(rel)
                    if matches(dest, index[rel]):
                        log.info("hub: %s already matches revision %s", rel, rev[:12])
                    else:
                        staged[rel] = stage / rel
                        staged[rel].parent.mkdir(parents=True, exist_ok=True)
                        self._fetch(rel, index[rel], rev, staged[rel])
                    out[rel] = dest
                    task.update(advance=index[rel].size)
            for rel, path in staged.items():
                out[rel].parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, out[rel])
                fsync_dir(out[rel].parent)
                log.info("hub: pulled %s at revision %s", rel, rev[:12])
        finally:
            shutil.rmtree(stage, ignore_errors=True)
            remove_empty_dirs(stage.parent, self.pod_dir)
        return out

    def read_bytes(self, rel: str, revision: str) -> bytes | None:
        """Verified bytes of a small tracked file at a full revision id (None: untracked)."""
        entry = self._index(revision).get(rel)      # one index read (a download on hf://)
        if entry is None:
            return None
        with self._fetched(rel, entry, revision) as path:
            return path.read_bytes()

    def fetched(self, rel: str, revision: str,
                sha256: str | None = None) -> ContextManager[Path]:
        """One verified file of `revision` (a full id) in its own scratch folder, deleted on
        exit; IntegrityError if `sha256` is given and the revision holds other bytes."""
        entry = self._index(revision).get(rel)
        if entry is None:
            raise HubError(f"not in revision {revision[:12]} of {self.url}: {rel}")
        if sha256 is not None and entry.sha256 != sha256:
            raise IntegrityError(f"{rel} at revision {revision[:12]} has sha256 "
                                 f"{entry.sha256[:12]}..., not the recorded {sha256[:12]}...")
        return self._fetched(rel, entry, revision)

    @contextmanager
    def _fetched(self, rel: str, entry: FileEntry, revision: str) -> Iterator[Path]:
        scratch = self.pod_dir / HUB_SCRATCH_DIR / f"read-{uuid.uuid4().hex[:12]}"
        scratch.mkdir(parents=True)
        try:
            local = scratch / Path(rel).name       # its own name, for the errors
            self._fetch(rel, entry, revision, local)
            yield local
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            try:
                scratch.parent.rmdir()    # only when no other operation is using it
            except OSError:
                pass

    def _local_files(self, files: PushFiles) -> dict[str, Path]:
        """Normalise push arguments to {pod-relative path: existing local file}."""
        pairs = files.items() if isinstance(files, Mapping) else ((p, None) for p in files)
        out: dict[str, Path] = {}
        for raw, local in pairs:
            rel = pod_relpath(raw)
            dest = self._destination(rel)
            path = dest if local is None else Path(local)
            if not path.is_file():
                raise HubError(f"cannot push {rel}: {path} is not a file")
            out[rel] = path
        if not out:
            raise ValueError("push needs at least one file")
        return out

    @staticmethod
    def _check_expected(got: Mapping[str, FileEntry], expected: Mapping[str, str] | None) -> None:
        for rel, sha in (expected or {}).items():
            if rel in got and got[rel].sha256 != sha:
                raise IntegrityError(
                    f"{rel}: its bytes have sha256 {got[rel].sha256[:12]}..., not the recorded "
                    f"{sha[:12]}... (changed on disk before the push); nothing committed")

    def _reserved_dirs(self) -> list[Path]:
        """Absolute directories inside the pod that synced files must never touch."""
        return [self.pod_dir.resolve() / HUB_SCRATCH_DIR]

    def _destination(self, rel: str) -> Path:
        """Where `rel` lives in the pod; refuses escapes and the store's own files."""
        dest = confine(self.pod_dir, rel)
        resolved = dest.resolve()
        if rel == INDEX_PATH or any(d == resolved or d in resolved.parents for d in self._reserved_dirs()):
            raise ValueError(f"{rel!r} is reserved for the hub store itself")
        return dest

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, pod_dir={str(self.pod_dir)!r})"


def next_index(parent: Mapping[str, FileEntry], entries: Mapping[str, FileEntry],
               drop: DropPaths | None) -> tuple[dict[str, FileEntry], list[str]]:
    """The index of a push of `entries` on `parent`, and the parent's paths it drops: those
    `drop` is true of that the push does not carry."""
    dropped = [] if drop is None else sorted(p for p in parent if p not in entries and drop(p))
    gone = set(dropped)
    index = {p: e for p, e in parent.items() if p not in gone}
    index.update(entries)
    return index, dropped


def remove_empty_dirs(path: Path, upto: Path) -> None:
    """Remove `path` and its parents below `upto` while they are empty."""
    while path != upto and upto in path.parents:
        try:
            path.rmdir()
        except OSError:
            return
        path = path.parent
