"""What makes a pulled file trustworthy: pod-relative paths, sha256, atomic installs, and the
hub index (`hub_index.json`, in the same commit as the files: path -> sha256, size). The
index is the store's own record, so the launcher's manifest may change shape freely."""

from __future__ import annotations

import errno
import json
import os
import re
import uuid
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Mapping

from launcher.files import FileEntry, file_entry, fsync_dir, sha256_stream

INDEX_PATH = "hub_index.json"
INDEX_FORMAT = "fractus-hub-index/1"

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class HubError(RuntimeError):
    """A hub operation failed: one line for the user; `status`: the HTTP status, if any."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class IntegrityError(HubError):
    """Bytes did not match the sha256/size recorded for them; they were not used."""


class PushConflict(HubError):
    """Another writer changed the same paths since the revision this push started from."""


def pod_relpath(path: str | os.PathLike) -> str:
    """POSIX form of a pod-relative path; ValueError for absolute, drive, `..` or empty."""
    text = os.fspath(path)
    if not isinstance(text, str) or not text or "\x00" in text:
        raise ValueError(f"invalid pod path {text!r}")
    if "\\" in text or PureWindowsPath(text).drive:
        raise ValueError(f"pod path must use '/' and no drive: {text!r}")
    posix = PurePosixPath(text)
    if posix.is_absolute():
        raise ValueError(f"pod path must be relative to the pod directory: {text!r}")
    parts = [p for p in posix.parts if p != "."]
    if not parts or any(p == ".." for p in parts):
        raise ValueError(f"pod path must stay inside the pod directory: {text!r}")
    return "/".join(parts)


def confine(pod_dir: Path, rel: str) -> Path:
    """Absolute location of `rel` inside `pod_dir`, refusing symlinked escapes."""
    rel = pod_relpath(rel)
    root = pod_dir.resolve()
    target = (root / rel).resolve()
    if target != root and root not in target.parents:
        raise ValueError(f"pod path resolves outside the pod directory: {rel!r}")
    return root / rel


def matches(path: Path, entry: FileEntry) -> bool:
    """True when `path` is a regular file holding exactly the recorded bytes."""
    try:
        if not path.is_file() or path.stat().st_size != entry.size:
            return False
        return file_entry(path).sha256 == entry.sha256
    except OSError:
        return False


def install_copy(src: Path, dest: Path, expected: FileEntry, what: str) -> None:
    """Copy `src` to `dest` atomically, hashing on the way; refuse (and leave nothing) on mismatch."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            got = sha256_stream(fin, fout)
            fout.flush()
            os.fsync(fout.fileno())
        _check(got, expected, what)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        tmp.unlink(missing_ok=True)


def install_staged(staged: Path, dest: Path, expected: FileEntry, what: str) -> None:
    """Verify a downloaded file, then move it into place atomically (copy across filesystems)."""
    try:
        got = file_entry(staged)
        _check(got, expected, what)
        with open(staged, "rb+") as f:
            os.fsync(f.fileno())
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(staged, dest)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            install_copy(staged, dest, expected, what)
            return
        fsync_dir(dest.parent)
    finally:
        staged.unlink(missing_ok=True)


def _check(got: FileEntry, expected: FileEntry, what: str) -> None:
    if got != expected:
        raise IntegrityError(
            f"{what}: got {got.size} bytes with sha256 {got.sha256[:12]}..., expected "
            f"{expected.size} bytes with sha256 {expected.sha256[:12]}...; refused"
        )


def encode_index(files: Mapping[str, FileEntry], push_id: str) -> bytes:
    """Canonical JSON (sorted keys) so the same content always gives the same bytes."""
    doc = {
        "format": INDEX_FORMAT,
        "push_id": push_id,
        "files": {p: {"sha256": e.sha256, "size": e.size} for p, e in sorted(files.items())},
    }
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()


def decode_index(data: bytes, where: str) -> tuple[dict[str, FileEntry], str | None]:
    """Parse and validate an index; a path escaping the pod or a malformed entry is refused."""
    try:
        doc = json.loads(data)
        if doc.get("format") != INDEX_FORMAT:
            raise ValueError(f"unknown format {doc.get('format')!r}")
        files: dict[str, FileEntry] = {}
        for raw_path, entry in doc["files"].items():
            sha, size = entry["sha256"], entry["size"]
            if not (isinstance(sha, str) and _SHA256.match(sha)) or not isinstance(size, int) or size < 0:
                raise ValueError(f"bad entry for {raw_path!r}")
            files[pod_relpath(raw_path)] = FileEntry(sha, size)
        return files, doc.get("push_id")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise IntegrityError(f"hub index at {where} is invalid: {exc}") from None


def conflicting_paths(
    base: Mapping[str, FileEntry], head: Mapping[str, FileEntry], ours: Mapping[str, FileEntry]
) -> list[str]:
    """Paths we push that another writer changed between `base` and `head` to other bytes."""
    return sorted(p for p, e in ours.items() if head.get(p) != base.get(p) and head.get(p) != e)
