"""A little disk space the launcher keeps for its last words.

When the disk fills, the launcher must still record why the pod stopped (a `pod_failed`
event, logs/pod_state.json for `status`, the sync state): at 0 bytes free even those
few lines fail. So it holds logs/.launcher_reserve (1 MiB of real blocks, written at
launch) and deletes it when it meets a full disk, just before writing them.
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
