"""hf:// backend: the Hugging Face Hub through the real `huggingface_hub.HfApi`.

A push is ONE commit: `preupload_lfs_files`, then one `create_commit` naming
`parent_commit`; on 409/412 (the branch moved) it re-applies on top if the other writer
touched other paths, else PushConflict. Not `upload_large_folder`: it splits an upload into
several commits. A commit whose answer was lost may have landed: the head is read for the
push's id before committing again, so a landed commit is never sent twice (each counts
against the Hub's hourly budget). Downloads pin the commit id and are verified in scratch.

A plain LFS endpoint (the test hub) needs `HF_HUB_DISABLE_XET=1` when `hf_xet` is installed.
The token never reaches our log lines or errors; the client's messages are scrubbed of it.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from datetime import timezone
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, TypeVar

import httpx2
from huggingface_hub import (CommitOperationAdd, CommitOperationDelete, HfApi, constants,
                             get_token, hf_hub_url, set_client_factory)
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import _http, build_hf_headers

from launcher.files import FileEntry, file_entry
from launcher.paths import HUB_SCRATCH_DIR

from .integrity import (
    INDEX_PATH,
    HubError,
    IntegrityError,
    PushConflict,
    conflicting_paths,
    decode_index,
    encode_index,
    install_staged,
)
from .hub_rate import note_answered, note_commit, note_wait
from .redact import scrub
from .retry import (RATE_LIMITED_STATUS, TRANSIENT_STATUS, RetryPolicy, describe, http_status,
                    with_retries)
from .retry_loop import attempts, retrying
from .store import DropPaths, HistoryEntry, PushFiles, Store, next_index

log = logging.getLogger(__name__)

T = TypeVar("T")
BRANCH = "main"
CONFLICT_STATUS = (409, 412)  # what the Hub answers when parent_commit is not the head
MAX_REBASES = 3  # re-applications on top of other writers' commits before giving up
DOWNLOAD_ATTEMPTS = 3  # downloads whose bytes fail verification are fetched again this often


class _ClientLines(logging.Handler):
    """The client's own lines (its upload retries) go, scrubbed, to the store's logger, so
    to logs/hub.log with the store's retries, not to the terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = scrub(" ".join(record.getMessage().split()))
        except Exception:
            self.handleError(record)
            return
        log.info("huggingface_hub %s: %s", record.levelname.lower(), text)


def _route_client_log() -> None:
    """Replace the client's stderr handler (unscrubbed) with _ClientLines; once per process."""
    client = logging.getLogger("huggingface_hub")
    if any(isinstance(h, _ClientLines) for h in client.handlers):
        return
    for handler in [h for h in client.handlers if type(h) is logging.StreamHandler]:
        client.removeHandler(handler)
    client.addHandler(_ClientLines())


def parse_hf_url(url: str) -> tuple[str, str]:
    """`hf://owner/repo` -> ("owner/repo", "model"); `hf://datasets/owner/repo` -> dataset."""
    parts = [p for p in url[len("hf://"):].split("/") if p]
    repo_type = constants.REPO_TYPE_MODEL
    if len(parts) == 3 and parts[0] in ("datasets", "models"):
        repo_type = parts[0][:-1]
        parts = parts[1:]
    if len(parts) != 2:
        raise ValueError(f"hub URL must look like hf://owner/repo, got {url!r}")
    return "/".join(parts), repo_type


class HfStore(Store):
    def __init__(
        self,
        url: str,
        pod_dir: Path,
        *,
        endpoint: str | None = None,
        token: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
        timeout_s: float = 10.0,
    ):
        super().__init__(pod_dir)
        self.repo_id, self.repo_type = parse_hf_url(url)
        self.url = url
        self.retry = retry
        self.timeout_s = timeout_s
        endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        # token=None lets the client find HF_TOKEN or its login cache on each call.
        self._api = HfApi(endpoint=endpoint, token=token)
        self._repo_ready = False
        # A commit's index never changes: read (or pushed) once per revision, kept here.
        self._indexes: dict[str, tuple[dict[str, FileEntry], str | None]] = {}
        # None: an earlier process may have left an incident open; the next answer closes it.
        self._limited: bool | None = None
        self._push_id: str | None = None  # of the push in progress: its delay is counted
        _install_client_timeouts()
        _route_client_log()

    # -- plumbing ------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T], what: str) -> T:
        """Run one client call with bounded retries; translate failures to one-line HubErrors."""
        try:
            result = with_retries(fn, f"{what} ({self.url})", self.retry,
                                  on_wait=self._rate_limited)
        except HubError:
            raise
        except Exception as exc:
            status = http_status(exc)
            if status is not None and status not in TRANSIENT_STATUS:
                self._answered()      # a real answer (404, a conflict): not rate-limited
            if status in CONFLICT_STATUS:
                raise  # the push loop handles conflicts
            message = self._scrub(f"{what} on {self.url} failed: {describe(exc)}")
            raise HubError(message, status=status) from None
        self._answered()
        return result

    def _answered(self) -> None:
        if self._limited is not False:
            self._limited = False
            note_answered(self.pod_dir)

    def _rate_limited(self, what: str, seconds: float, told: float | None) -> None:
        self._limited = True
        note_wait(self.pod_dir, what, seconds, told, self._push_id)

    def _scrub(self, text: str) -> str:
        secret = self._api.token or _client_token()
        return text.replace(secret, "<redacted>") if secret else text

    def _scratch(self) -> Path:
        path = self.pod_dir / HUB_SCRATCH_DIR / f"tmp-{uuid.uuid4().hex[:12]}"
        path.mkdir(parents=True)
        return path

    def _cleanup(self, scratch: Path) -> None:
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            scratch.parent.rmdir()  # only succeeds when no other operation is using it
        except OSError:
            pass

    def _download(self, rel: str, revision: str, into: Path) -> Path:
        got = self._call(
            lambda: self._api.hf_hub_download(
                self.repo_id, rel, repo_type=self.repo_type, revision=revision,
                local_dir=into, etag_timeout=self.timeout_s,  # `into` is always a fresh, empty dir
            ),
            f"download of {rel}@{revision[:12]}",
        )
        return Path(got)

    def download_request(self, rel: str, revision: str) -> tuple[str, dict[str, str]]:
        """URL and auth headers of `rel` at `revision`, for a resumable stream (fetch.py)."""
        url = hf_hub_url(self.repo_id, rel, repo_type=self.repo_type, revision=revision,
                         endpoint=self._api.endpoint)
        return url, build_hf_headers(token=self._api.token)

    # -- reading -------------------------------------------------------------------------
    def head(self) -> str | None:
        try:
            info = self._call(
                lambda: self._api.repo_info(
                    self.repo_id, repo_type=self.repo_type, revision=BRANCH, timeout=self.timeout_s
                ),
                "reading the head",
            )
        except HubError as exc:
            if exc.status == 404:
                return None
            raise
        return info.sha

    def resolve(self, revision: str | None) -> str:
        rev = revision or BRANCH
        try:
            info = self._call(
                lambda: self._api.repo_info(
                    self.repo_id, repo_type=self.repo_type, revision=rev, timeout=self.timeout_s
                ),
                f"resolving revision {rev}",
            )
        except HubError as exc:
            if exc.status == 404:
                raise HubError(f"unknown revision {rev!r} in {self.url} (or the repo is missing)", 404) from None
            raise
        if not info.sha:
            raise HubError(f"{self.url} has no revisions yet; push one first with "
                           f"`fractus-pod sync push`", 404)
        return info.sha

    def _index(self, revision: str) -> dict[str, FileEntry]:
        return self._read_index(revision)[0]

    def _read_index(self, revision: str) -> tuple[dict[str, FileEntry], str | None]:
        """(index, push_id) at a full commit id; a commit without index tracks nothing."""
        if revision not in self._indexes:
            self._indexes[revision] = self._download_index(revision)
        index, push_id = self._indexes[revision]
        return dict(index), push_id

    def _download_index(self, revision: str) -> tuple[dict[str, FileEntry], str | None]:
        scratch = self._scratch()
        try:
            try:
                path = self._download(INDEX_PATH, revision, scratch)
            except HubError as exc:
                if exc.status == 404:
                    return {}, None
                raise
            return decode_index(path.read_bytes(), f"{self.url}@{revision[:12]}")
        finally:
            self._cleanup(scratch)

    def history(self) -> list[HistoryEntry]:
        try:
            commits = self._call(
                lambda: self._api.list_repo_commits(self.repo_id, repo_type=self.repo_type, revision=BRANCH),
                "listing commits",
            )
        except HubError as exc:
            if exc.status == 404:
                return []
            raise
        return [
            HistoryEntry(c.commit_id, c.title, c.created_at.astimezone(timezone.utc)) for c in commits
        ]

    def _fetch(self, rel: str, entry: FileEntry, revision: str, dest: Path) -> None:
        what = f"{rel} at revision {revision[:12]}"

        def download() -> None:
            scratch = self._scratch()
            try:
                install_staged(self._download(rel, revision, scratch), dest, entry, what)
            finally:
                self._cleanup(scratch)
        try:
            retrying(download, attempts(
                DOWNLOAD_ATTEMPTS, lambda exc: isinstance(exc, IntegrityError),
                on_retry=lambda exc, n: log.warning("hub: %s; downloading again (%d/%d)", exc,
                                                    n + 1, DOWNLOAD_ATTEMPTS)))
        except IntegrityError as exc:
            raise IntegrityError(f"{exc} ({DOWNLOAD_ATTEMPTS} downloads)") from None

    # -- storage -------------------------------------------------------------------------
    def stored_objects(self) -> dict[str, int]:
        try:
            listing = self._call(lambda: list(self._api.list_lfs_files(
                self.repo_id, repo_type=self.repo_type)), "listing LFS files")
        except HubError as exc:
            if exc.status != 404:
                raise
            listing = []
        return {f.file_oid: f.size for f in listing}

    def delete_objects(self, shas: list[str]) -> None:
        if not shas:
            return
        # The call reads only `file_oid` (the sha256) of each item, so no listing first.
        # rewrite_history=False: the commits stay (their small files, `sync history`).
        self._call(lambda: self._api.permanently_delete_lfs_files(
            self.repo_id, [LfsObject(sha) for sha in shas], rewrite_history=False,
            repo_type=self.repo_type), "deleting LFS files")

    # -- writing -------------------------------------------------------------------------
    def _ensure_repo(self) -> None:
        if not self._repo_ready:
            self._call(
                lambda: self._api.create_repo(
                    self.repo_id, repo_type=self.repo_type, private=True, exist_ok=True
                ),
                "creating the repo",
            )
            self._repo_ready = True

    def push(self, files: PushFiles, message: str, *, base: str | None = None,
             expected: Mapping[str, str] | None = None, drop: DropPaths | None = None) -> str:
        local = self._local_files(files)
        # One read per file: this hash names the LFS object, and it is checked against the
        # recorded one before any byte leaves, so the hub never holds an object under a hash
        # its bytes do not have (a later push of the real bytes would be deduplicated
        # against it on a hub that does not verify uploads).
        entries = {rel: file_entry(path) for rel, path in local.items()}
        self._check_expected(entries, expected)
        self._ensure_repo()
        push_id = uuid.uuid4().hex
        self._push_id = push_id
        try:
            return self._push(local, entries, message, base, push_id, drop)
        finally:
            self._push_id = None

    def _push(self, local: dict[str, Path], entries: dict[str, FileEntry], message: str,
              base: str | None, push_id: str, drop: DropPaths | None) -> str:
        base = self.resolve(base)
        base_index = self._index(base)
        ops = []
        for rel, path in local.items():
            op = CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path))
            op.upload_info.sha256 = bytes.fromhex(entries[rel].sha256)  # no second read
            ops.append(op)
        self._call(
            lambda: self._api.preupload_lfs_files(
                self.repo_id, additions=ops, repo_type=self.repo_type, revision=BRANCH, free_memory=False
            ),
            "uploading large files",
        )
        parent, parent_index = base, base_index
        for _ in range(MAX_REBASES + 1):
            # The paths dropped go from the tree too (each a path of the index it lands
            # on, so one the tree holds): recomputed on each head it is re-applied to.
            index, dropped = next_index(parent_index, entries, drop)
            deletes = [CommitOperationDelete(path_in_repo=rel) for rel in dropped]
            index_op = CommitOperationAdd(INDEX_PATH, encode_index(index, push_id))
            oid = self._commit([*ops, *deletes, index_op], message, parent)
            if oid is not None:
                log.info("hub: pushed %d file(s) to %s as %s", len(entries), self.url, oid[:12])
                note_commit(self.pod_dir, oid, self.url)
                self._indexes[oid] = (index, push_id)
                self.parents[oid] = parent
                return oid
            head = self.resolve(None)
            head_index, head_push_id = self._read_index(head)
            if head_push_id == push_id:
                log.info("hub: the commit to %s landed as %s; its answer was lost",
                         self.url, head[:12])
                note_commit(self.pod_dir, head, self.url)
                self.parents[head] = parent
                return head  # an earlier attempt landed but its answer was lost
            clash = conflicting_paths(base_index, head_index, entries)
            if clash:
                raise PushConflict(
                    f"{self.url} moved from {base[:12]} to {head[:12]} and changed "
                    f"{', '.join(clash)}; pull and retry instead of overwriting"
                )
            log.info("hub: %s moved to %s (other paths); re-applying push", self.url, head[:12])
            parent, parent_index = head, head_index
        raise PushConflict(f"{self.url} kept moving during the push; gave up after {MAX_REBASES} re-applications")


    def _commit(self, operations: list, message: str, parent: str) -> str | None:
        """One commit on `parent`: its id, or None when the branch is no longer there. After
        a failed try (not a 429: nothing landed) the head is read, never the commit resent."""
        unsure = False

        def attempt() -> str | None:
            nonlocal unsure
            if unsure and self.resolve(None) != parent:
                return None
            unsure = True
            try:
                return self._api.create_commit(
                    self.repo_id, operations, commit_message=message,
                    repo_type=self.repo_type, revision=BRANCH, parent_commit=parent,
                ).oid
            except HfHubHTTPError as exc:
                if http_status(exc) in CONFLICT_STATUS:
                    return None
                unsure = http_status(exc) != RATE_LIMITED_STATUS
                raise

        return self._call(attempt, "committing")


class LfsObject(NamedTuple):
    """Stands in for `LFSFileInfo` in `permanently_delete_lfs_files`: only `file_oid` is read."""
    file_oid: str


def _client_token() -> str | None:
    try:
        return get_token()
    except Exception:
        return None


# The client's default HTTP session waits forever on a silent server (timeout=None), so a
# stalled commit would block every later sync. Requests that pass no timeout of their own
# (create_commit, LFS uploads) get these instead; downloads keep their explicit ones.
CLIENT_TIMEOUT = httpx2.Timeout(connect=10.0, read=120.0, write=120.0, pool=10.0)
_timeouts_installed = False


def _install_client_timeouts() -> None:
    """Give huggingface_hub's shared session finite timeouts, unless the process set its own."""
    global _timeouts_installed
    if _timeouts_installed:
        return
    _timeouts_installed = True
    if getattr(_http, "_GLOBAL_CLIENT_FACTORY", None) is not _http.default_client_factory:
        return  # someone configured the client deliberately: leave it alone

    def factory() -> httpx2.Client:
        return httpx2.Client(
            event_hooks={"request": [_http.hf_request_event_hook]},
            follow_redirects=True,
            timeout=CLIENT_TIMEOUT,
        )

    set_client_factory(factory)
