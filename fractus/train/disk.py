"""Telling a full disk apart from other write failures, for the worker and the launcher.

torch.save reports a full disk as `RuntimeError: [enforce fail at inline_container.cc:672]
... unexpected pos ...`, the ENOSPC OSError only in its context."""

from __future__ import annotations

import errno
import os
import shutil

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def no_space_error(exc: BaseException | None) -> OSError | None:
    """The no-space OSError behind `exc` (itself, its cause or its context), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def describe_disk_full(path: str | os.PathLike, exc: OSError) -> str:
    """One line: disk full, and the free space left on the disk holding `path`."""
    try:
        free = f"{shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or '.').free:,}"
    except OSError:
        free = "unknown"
    return f"disk full: {exc.strerror or exc} ({free} bytes free on the disk of {path})"
