"""One launcher per pod: an exclusive flock on logs/launcher.lock, held for the launcher's life.
The kernel releases it when the holder dies (even by SIGKILL); the file's content is for
messages only.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import uuid
from pathlib import Path

from launcher.paths import LOCK_FILE
from launcher.errors import PodBusy



class PodLock:
    def __init__(self, pod_dir: Path):
        self.path = pod_dir / LOCK_FILE
        self._fd: int | None = None
        # What the lock file held, and whether logs/ was made here (release(restore) puts back).
        self._before: bytes | None = None
        self._made_dir = False
        # Names this launcher in requests made to it; unlike the pid, survives --detach's fork.
        self.launcher_id = uuid.uuid4().hex

    def acquire(self) -> None:
        self._made_dir = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                with open(self.path, "rb") as f:
                    self._before = f.read()
            except FileNotFoundError:
                self._before = None
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                info = read_holder(self.path.parents[1]) or {}
                raise PodBusy(f"another launcher (pid {info.get('pid', '?')}) holds this pod "
                              f"({self.path}); stop it first with `fractus-pod stop`") from None
            if _same_file(fd, self.path):
                break
            # A refused launch removed the file it had created between our open and our
            # flock: the lock we hold is on a file nobody else will open. Take the new one.
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self._fd = fd
        self.record_holder()

    def record_holder(self) -> None:
        """Write our pid into the lock file (again after --detach forks)."""
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps({"pid": os.getpid(), "since": time.time(),
                                        "launcher_id": self.launcher_id}).encode(), 0)

    def release(self, restore: bool = False) -> None:
        """Unlock; `restore` (a refused launch) first puts the lock file back as it was."""
        if self._fd is not None and restore:
            if self._before is None:
                self.path.unlink(missing_ok=True)
                if self._made_dir:
                    try:
                        self.path.parent.rmdir()
                    except OSError:
                        pass        # something else was written there meanwhile
            else:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, self._before, 0)
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def read_holder(pod_dir: Path) -> dict | None:
    """The live launcher's {"pid", "since", "launcher_id"}; None when none holds the pod."""
    path = pod_dir / LOCK_FILE
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            except (json.JSONDecodeError, UnicodeDecodeError):
                return {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
