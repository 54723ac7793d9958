"""A little disk space the launcher keeps for its last words (why the pod stopped), freed
when it meets a full disk. Owner: the run's ending (launcher/supervise/ending.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.paths import RESERVE_FILE

RESERVE_BYTES = 1 << 20


class DiskReserve:
    def __init__(self, pod_dir: Path):
        self.path = pod_dir / RESERVE_FILE
        try:
            with open(self.path, "wb") as f:      # zeros written, not a sparse hole
                f.write(b"\0" * RESERVE_BYTES)
                f.flush()
                os.fsync(f.fileno())
        except OSError:                 # already full: nothing to hold back
            self.path.unlink(missing_ok=True)

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
