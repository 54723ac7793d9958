"""The worker process of one GPU on a Ray node, and the node's fence.

Invariant: never two workers of one GPU. The worker gets SIGTERM when its parent, the
actor, dies; a node that hears nothing for its fence (a partition, a SIGSTOPped raylet, the
launcher killed) SIGTERMs its worker (SIGKILL after the grace) and exits; the launcher's side
is fence.py. Owner: `ProcessHost`, which NodeWorker holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from launcher import child
from launcher.paths import worker_log_path
from launcher.worker.process import MetricsTail, kill, terminate

FENCE_CHECK_S = 1.0             # how often an actor looks at its last heartbeat
ADOPT_CHECK_S = 0.2             # how often `adopt` looks whether the previous worker ended


class ProcessHost:
    def __init__(self, gpu: int, workdir: Path, command: list[str], fence_s: float,
                 grace_s: float, seen: Callable[[bytes], bytes]):
        self.gpu, self.workdir, self.command = gpu, workdir, command
        self.seen = seen                  # each complete line, as the launcher gets it
        self.proc: subprocess.Popen | None = None
        self.tail: MetricsTail | None = None     # the running worker's METRICS file
        self.lock = threading.Lock()      # poll, kill and push run on several actor threads
        self.fence_s, self.grace_s = fence_s, grace_s
        self.fence_grace_s = grace_s      # a fenced worker's; the heartbeats may shorten it
        self.heard = time.monotonic()     # the launcher's last call (heartbeat or start)
        threading.Thread(target=self._fence, name="fence", daemon=True).start()

    def spawn(self, env: dict[str, str], keep: list[str], metrics: str) -> int:
        """Start the worker; returns the metrics file offset its lines begin at."""
        with self.lock:
            self.tail = MetricsTail(self.workdir / metrics)
            with open(self.workdir / worker_log_path(self.gpu), "ab") as log:
                self.proc = child.spawn(self.command, cwd=self.workdir, env=env, keep=keep,
                                        stdout=log, stderr=subprocess.STDOUT,
                                        death_signal=signal.SIGTERM)
            return self.tail.position

    def heartbeat(self, fence_s: float | None = None, grace_s: float | None = None) -> None:
        """The launcher is there, with the deadlines to keep from now (fence.Deadlines)."""
        self.heard = time.monotonic()
        if fence_s is not None and grace_s is not None:
            self.fence_s, self.fence_grace_s = float(fence_s), float(grace_s)

    def _fence(self) -> None:
        while time.monotonic() - self.heard < self.fence_s:
            time.sleep(FENCE_CHECK_S)
        silent = time.monotonic() - self.heard
        proc = self.proc
        self.note(f"fenced: no heartbeat from the launcher for {silent:.0f}s (fence "
                  f"{self.fence_s:g}s); stopping the worker (SIGTERM: it saves its final "
                  f"checkpoint on this node; SIGKILL after {self.fence_grace_s:g}s)")
        if proc is not None:
            terminate([proc], self.fence_grace_s)
            self.note(f"fenced: worker pid {proc.pid} ended with code {proc.returncode}; "
                      f"the actor exits")
        os._exit(0)        # nobody will call it again: its resources go back to the cluster

    def note(self, text: str) -> None:
        """A line in the GPU's worker log on this node."""
        with open(self.workdir / worker_log_path(self.gpu), "a") as log:
            log.write(f"[fractus-pod {time.strftime('%Y-%m-%d %H:%M:%S')}] {text}\n")

    def poll(self) -> tuple[int | None, bytes, int]:
        """(exit code or None, the complete metrics lines since the last poll, the byte
        offset they end at: where a replacement actor goes on reading, see `adopt`)."""
        with self.lock:
            code = self.proc.poll() if self.proc is not None else None
            lines = self._new_lines()          # after the exit code: nothing is left behind
            return code, lines, self.tail.position if self.tail is not None else 0

    def adopt(self, pid: int, metrics: str, offset: int) -> tuple[int | None, bytes]:
        """Take over from this GPU's previous actor on this node, which died: wait for its
        worker `pid` (SIGTERMed with it, saving) to end, SIGKILL after grace_s, then hand
        over the lines it wrote past `offset`, its final checkpoint event among them."""
        deadline = time.monotonic() + self.grace_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(ADOPT_CHECK_S)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            while _alive(pid):
                time.sleep(ADOPT_CHECK_S)
        self.heard = time.monotonic()
        with self.lock:
            self.tail = MetricsTail(self.workdir / metrics, offset=offset)
            return None, self._new_lines()

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill(self) -> tuple[int | None, bytes]:
        with self.lock:
            if self.proc is not None:
                kill(self.proc)
            return (self.proc.returncode if self.proc else None), self._new_lines()

    def terminate(self, grace_s: float) -> tuple[int | None, bytes]:
        """SIGTERM (the worker checkpoints), SIGKILL after grace_s."""
        if self.proc is not None:
            terminate([self.proc], grace_s)
        with self.lock:
            return (self.proc.returncode if self.proc else None), self._new_lines()

    def _new_lines(self) -> bytes:
        lines = self.tail.read_lines() if self.tail is not None else []
        return b"".join(self.seen(line) + b"\n" for line in lines)


def _alive(pid: int) -> bool:
    """The process runs (a zombie has ended: it only waits to be reaped)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
