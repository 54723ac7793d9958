"""The one way fractus-pod writes and hashes its files: atomic writes (readers see the old
file or the new one, never a torn one, even after a crash), sha256 (every hash goes through
sha256_stream), and small JSON state files.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

CHUNK = 8 << 20  # 8 MiB reads: large enough that hashing, not syscalls, sets the pace


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_with(path: Path, write: Callable[[BinaryIO], None], durable: bool = True) -> None:
    """`write(f)` into a temp file beside `path`, fsync, rename over it, fsync the directory.
    `durable=False`: no fsync, for a cache its reader rebuilds after a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)       # mkstemp makes 0600; manifests and states are read by people
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    atomic_write_with(path, lambda f: f.write(data), durable)


def atomic_write_text(path: Path, text: str, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), durable)


@dataclass(frozen=True)
class FileEntry:
    """The identity of a file's bytes (the hub records one per tracked path)."""
    sha256: str
    size: int


def sha256_stream(src: BinaryIO, sink: BinaryIO | None = None,
                  on_bytes: Callable[[int], None] | None = None) -> FileEntry:
    """Hash `src` to its end, copying to `sink` if given; `on_bytes(n)` after each chunk."""
    digest = hashlib.sha256()
    size = 0
    while chunk := src.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return FileEntry(digest.hexdigest(), size)


def file_entry(path: Path, on_bytes: Callable[[int], None] | None = None) -> FileEntry:
    """sha256 and size of the file at `path`."""
    with open(path, "rb") as f:
        return sha256_stream(f, on_bytes=on_bytes)


def sha256_file(path: str | os.PathLike, on_bytes: Callable[[int], None] | None = None) -> str:
    """Hex sha256 of the file at `path`."""
    return file_entry(Path(path), on_bytes).sha256


def read_json_state(path: Path) -> dict:
    """A JSON state file as a dict; {} when it is missing, being replaced, or not a mapping."""
    try:
        state = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def write_json_state(path: Path, state: dict, indent: int | None = None,
                     durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(state, default=str, indent=indent) + "\n", durable)


def dir_id(path: Path) -> tuple | None:
    """(device, inode) of a directory, None if none: the same folder, not just its name."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None
