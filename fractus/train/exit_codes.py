"""The worker's exit codes: the one list the worker returns and the launcher reads.

In fractus/ because the worker also runs without the launcher (the user's scripts).
docs/WORKER.md's "Exit codes" table is checked against it (tests/test_worker_docs.py)."""

from __future__ import annotations

from enum import IntEnum


class WorkerExitCode(IntEnum):
    OK = 0          # done: MAX_STEPS, end of shard, or stopped by a signal
    CRASH = 1       # any other crash (error event)
    SETTINGS = 2    # bad settings or input files (one line on stderr)
    NAN = 3         # non-finite loss or gradient norm (nan event, no checkpoint)
    OOM = 4         # out of memory (oom event)
    DISK_FULL = 5   # a checkpoint or metrics write found no space

