"""Before a worker starts, its shards are on this machine with the bytes `data:` records
(called by the launcher, or a Ray node for its own GPUs). A stamp in logs/data_verified.json
spares re-hashing a 4 GB shard at each launch; a local file with other bytes is refused,
never overwritten (it may be the user's own); a missing one is fetched, resumable across
processes through `<shard>.partial`. Details: docs/LAUNCHER.md "Shards on the hub"."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from huggingface_hub.file_download import http_get

from launcher.config.data_settings import DataSource
from launcher.errors import UserError
from launcher.files import CHUNK, FileEntry, atomic_write_text, file_entry, fsync_dir
from launcher.paths import DATA_VERIFIED_FILE
from launcher.pod.progress import Task, progress

from .data_source import data_store, shard_paths_in_store, shard_records
from .hf import HfStore
from .integrity import HubError, IntegrityError
from .retry import RetryPolicy, describe, http_status
from .retry_loop import attempts, retrying

FETCH_ATTEMPTS = 2      # a fetch whose bytes differ from the record is redone once, from 0
PARTIAL_SUFFIX = ".partial"


def ensure_shards(paths: list[str], source: DataSource, pod_dir: Path,
                  retry: RetryPolicy = RetryPolicy()) -> list[str]:
    """Every shard in `paths` present and verified; returns those fetched. UserError: store
    unreadable, shard unrecorded, or local file with other bytes; HubError: a fetch failed
    (rerun resumes); IntegrityError: the store served other bytes (nothing installed)."""
    paths = shard_paths_in_store(list(dict.fromkeys(paths)), source.url)
    stamps = Stamps(pod_dir, source)
    unverified = [p for p in paths if not stamps.holds(p)]
    if not unverified:
        return []
    store, records = _recorded(unverified, source, pod_dir, retry)
    fetched = []
    with progress("data: verifying shards", sum(records[p].size for p in unverified),
                  "bytes") as task:
        for rel in unverified:
            dest, record = pod_dir / rel, records[rel]
            task.update(description=f"data: {rel}")
            if dest.is_file():
                got = file_entry(dest)
                task.update(advance=record.size)
                if got != record:
                    raise UserError(f"data: {rel} holds other bytes than revision "
                                    f"{source.revision[:12]} of {source.url} records "
                                    f"(sha256 {got.sha256[:12]}..., not "
                                    f"{record.sha256[:12]}...); move it away to fetch the "
                                    f"recorded shard, or point data: at the revision that "
                                    f"holds it")
            else:
                _fetch(store, rel, record, source, dest, task)
                fetched.append(rel)
            stamps.add(rel, record)
    return fetched


def check_recorded(paths: list[str], source: DataSource, pod_dir: Path,
                   retry: RetryPolicy = RetryPolicy()) -> None:
    """UserError unless the store records every shard in `paths` (one index read, nothing
    fetched): a Ray head refuses at launch a store its nodes could not use."""
    _recorded(shard_paths_in_store(list(dict.fromkeys(paths)), source.url), source, pod_dir,
              retry)


def _recorded(paths: list[str], source: DataSource, pod_dir: Path,
              retry: RetryPolicy) -> tuple[object, dict[str, FileEntry]]:
    with _hub_log_held_back():      # a refusal writes nothing and says one line
        store = data_store(source.url, pod_dir, retry)
        try:
            return store, shard_records(store, source, paths)
        except HubError as exc:
            raise UserError(f"data: cannot read revision {source.revision[:12]} of "
                            f"{source.url} ({exc}); check data: url and revision in "
                            f"fractus-pod.yaml, and that the store is reachable") from None


def _fetch(store, rel: str, record: FileEntry, source: DataSource, dest: Path,
           task: Task) -> None:
    if not isinstance(store, HfStore):
        store.pull([rel], source.revision)      # copied and hashed in one pass, staged
        task.update(advance=record.size)
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + PARTIAL_SUFFIX)
    what = f"{rel} at revision {source.revision[:12]} of {source.url}"
    log = logging.getLogger(__name__)

    def fetch() -> None:
        started = task.completed
        got = _download(store, rel, record, source.revision, partial, task)
        if got != record:
            partial.unlink()
            task.update(completed=started)
            raise _OtherBytes(f"data: {what} arrived as {got.size} bytes with sha256 "
                              f"{got.sha256[:12]}..., not the recorded {record.sha256[:12]}...")
        os.replace(partial, dest)
        fsync_dir(dest.parent)
    try:
        retrying(fetch, attempts(FETCH_ATTEMPTS, lambda exc: isinstance(exc, _OtherBytes),
                                 on_retry=lambda exc, _: log.warning("%s; fetching it again", exc)))
    except _OtherBytes as exc:
        log.warning("%s", exc)
        raise IntegrityError(f"data: {what} arrived twice with other bytes than recorded; "
                             f"refused (nothing installed, never trained on)") from None


class _OtherBytes(IntegrityError):
    """A fetched shard's bytes are not the recorded ones (fetched again once, from 0)."""


def _download(store: HfStore, rel: str, record: FileEntry, revision: str, partial: Path,
              task: Task) -> FileEntry:
    """The shard into `partial`, resumed from its length; (sha256, size) of the whole file."""
    digest = hashlib.sha256()
    with open(partial, "ab+") as f:
        f.seek(0)
        if os.fstat(f.fileno()).st_size > record.size:      # not this shard's beginning
            f.truncate(0)
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            task.update(advance=len(chunk))
        resume = f.tell()
        url, headers = store.download_request(rel, revision)
        sink = _HashingSink(f, digest, task, resume)
        try:
            # The client's own downloader: its Range header, its retries that resume within
            # this process, its handling of a server that ignores the Range.
            http_get(url, sink, resume_size=resume, headers=headers, expected_size=record.size,
                     displayed_filename=rel, tqdm_class=_NoBar)
        except Exception as exc:
            f.flush()
            held = f.tell()
            status = http_status(exc)
            message = (f"data: fetching {rel} from {store.url} failed "
                       f"({describe(exc)}); {held} of {record.size} bytes are "
                       f"kept in {partial.name}: rerun to resume")
            raise HubError(message, status=status) from None
        f.flush()
        os.fsync(f.fileno())
        return FileEntry(sink.digest.hexdigest(), f.tell())


class _HashingSink:
    """The .partial file as http_get writes it: each byte hashed on its way to disk."""

    def __init__(self, f, digest, task: Task, resumed: int):
        self._f, self.digest, self._task, self._resumed = f, digest, task, resumed

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self._task.update(advance=len(data))
        return self._f.write(data)

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        """http_get rewinds to 0 when the server answered a Range with the whole file."""
        if (self._f.tell() if size is None else size) != 0:
            raise IntegrityError("data: a download rewound to the middle of a shard")
        self.digest = hashlib.sha256()
        self._task.update(advance=-self._resumed)
        self._resumed = 0
        return self._f.truncate(0)


class _NoBar:
    """The client's progress bar, silenced: launcher/pod/progress.py shows the fetch."""

    def __init__(self, *args, **kwargs):
        pass

    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        pass


class Stamps:
    """logs/data_verified.json: verified shards, by size and mtime, for this url and revision."""

    def __init__(self, pod_dir: Path, source: DataSource):
        self.path, self.pod_dir, self.source = pod_dir / DATA_VERIFIED_FILE, pod_dir, source
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            doc = {}
        same = isinstance(doc, dict) and doc.get("url") == source.url and \
            doc.get("revision") == source.revision and isinstance(doc.get("files"), dict)
        self.files: dict = doc["files"] if same else {}

    def _stat(self, rel: str) -> dict | None:
        try:
            st = (self.pod_dir / rel).stat()
        except OSError:
            return None
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def holds(self, rel: str) -> bool:
        stamp, now = self.files.get(rel), self._stat(rel)
        return isinstance(stamp, dict) and now is not None and \
            {k: stamp.get(k) for k in now} == now

    def add(self, rel: str, record: FileEntry) -> None:
        self.files[rel] = {**self._stat(rel), "sha256": record.sha256}
        atomic_write_text(self.path, json.dumps({"url": self.source.url,
                                                 "revision": self.source.revision,
                                                 "files": self.files}, indent=1) + "\n")


@contextmanager
def _hub_log_held_back() -> Iterator[None]:
    """Hold back the first contact's retry lines until it succeeds: a refused launch says one
    line and writes no logs/hub.log."""
    logger = logging.getLogger("launcher.hub")
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [Hold()], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    for record in held:
        logger.handle(record)
