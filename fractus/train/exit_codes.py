"""The worker's exit codes: the one list the worker returns and the launcher reads.

Here in fractus/ rather than launcher/ because the worker (fractus/train/worker.py) runs
without the launcher (the user's own scripts start it); the launcher imports this module.
docs/WORKER.md's "Exit codes" table lists the same codes (tests/test_worker_docs.py
checks it against this enum)."""

from __future__ import annotations

from enum import IntEnum


class WorkerExitCode(IntEnum):
    OK = 0          # done: MAX_STEPS, end of shard, or stopped by a signal
    CRASH = 1       # any other crash (error event)
    SETTINGS = 2    # bad settings or input files (one line on stderr)
    NAN = 3         # non-finite loss or gradient norm (nan event, no checkpoint)
    OOM = 4         # out of memory (oom event)
    DISK_FULL = 5   # a checkpoint or metrics write found no space

