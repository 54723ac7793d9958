"""A WorkerBackend with no processes, for fast tests of the supervision logic.

Each "worker" is a record the test drives: it writes the metrics and checkpoint lines a
real worker would (into the pod's metrics file, which the supervisor tails as usual),
exits with a code, hangs by staying silent, or loses its node. SIGTERM makes it checkpoint
and exit 0, as the real worker does, unless the test told it to ignore signals. What
becomes of a checkpoint is the custodian's (tests/support/fake_custodian.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher.supervise.backend import WorkerBackend, WorkerExit, WorkerHandle
from launcher.worker.process import WorkerSpec

TOKENS_PER_STEP = 64


@dataclass(eq=False)
class FakeWorker(WorkerHandle):
    spec: WorkerSpec | None = None
    step: int = 0
    next_token: int = 0
    ended: WorkerExit | None = None
    signals: list = field(default_factory=list)
    ignores_sigterm: bool = False


class FakeBackend(WorkerBackend):
    name = "fake"

    def __init__(self, pod_dir: Path, nodes: dict[str, int] | None = None):
        super().__init__(pod_dir)
        self.pids = itertools.count(1000)
        self.started: list[FakeWorker] = []
        self.free = dict(nodes or {"node-a": 8})       # node -> free devices
        self.unreachable: set[str] = set()     # gone, but no exit reported yet (a silent node)
        self.adopting: set[int] = set()        # GPUs whose actor died: a new one takes over
        self.closed = False

    # ---- the backend interface -------------------------------------------------------
    def start(self, spec: WorkerSpec) -> FakeWorker:
        node = next((n for n, free in sorted(self.free.items()) if free > 0), None)
        assert node is not None, "started with no free device"
        self.free[node] -= 1
        worker = FakeWorker(spec.slot.gpu, next(self.pids), node, spec=spec,
                            next_token=spec.start_token or 0,
                            step=(spec.start_token or 0) // TOKENS_PER_STEP)
        self.started.append(worker)
        self.line(worker, {"type": "event", "event": "start", "next_token": worker.next_token,
                           "step": worker.step})
        return worker

    def poll(self, handle: FakeWorker) -> WorkerExit | None:
        return handle.ended

    def settling(self, handle: FakeWorker) -> bool:
        return handle.ended is None and handle.gpu in self.adopting

    def signal(self, handle: FakeWorker, signum: int) -> None:
        handle.signals.append(signum)

    def kill(self, handle: FakeWorker) -> WorkerExit:
        handle.signals.append(signal.SIGKILL)
        lost = handle.node in self.unreachable
        self._end(handle, WorkerExit(None, node_lost=True) if lost else WorkerExit(-9))
        return handle.ended

    def stop(self, handles, grace_s):
        for handle in handles:
            handle.signals.append(signal.SIGTERM)
            if handle.ended is None and not handle.ignores_sigterm:
                self.checkpoint(handle)
                self._end(handle, WorkerExit(0))
            elif handle.ended is None:
                self._end(handle, WorkerExit(-9))      # SIGKILL after the grace
        return {h.gpu: h.ended for h in handles}

    def can_place(self, slot) -> bool:
        return any(free > 0 for free in self.free.values())

    def close(self) -> None:
        self.closed = True

    # ---- what the test makes a worker do ------------------------------------------------
    def current(self, gpu: int) -> FakeWorker:
        return [w for w in self.started if w.gpu == gpu][-1]

    def line(self, worker: FakeWorker, record: dict) -> None:
        path = self.metrics_file(worker.gpu)
        if path.is_dir():      # replaced under a real worker, whose open file lives on
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"gpu": worker.gpu, **record}) + "\n")

    def train(self, gpu: int, steps: int, tf: float = 5.0, lb: float = 2.0,
              tok_s: float = 1000.0) -> None:
        worker = self.current(gpu)
        for _ in range(steps):
            worker.step += 1
            worker.next_token += TOKENS_PER_STEP
            self.line(worker, {"type": "metrics", "step": worker.step,
                               "next_token": worker.next_token, "tf": tf, "ema_tf": tf,
                               "ss": tf, "ema_ss": tf, "lb": lb, "grad_norm": 1.0,
                               "tok_s": tok_s})

    def checkpoint(self, worker: FakeWorker | int, ema_tf: float | None = 5.0) -> dict:
        worker = self.current(worker) if isinstance(worker, int) else worker
        path = self.pod_dir / "checkpoints" / f"fractus_1b_gpu{worker.gpu}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = f"gpu{worker.gpu} token{worker.next_token}".encode()
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(payload)
        os.replace(tmp, path)
        event = {"type": "event", "event": "checkpoint", "path": str(path),
                 "sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload),
                 "next_token": worker.next_token, "step": worker.step, "ema_tf": ema_tf,
                 "lb": 2.0, "ts": time.time(), "phase": worker.spec.phase}
        self.line(worker, event)
        return event

    def end_of_shard(self, gpu: int) -> None:
        """The worker reached the end of its phase's shard: its `done` event, then exit 0."""
        worker = self.current(gpu)
        self.event(gpu, "done", reason="end_of_shard", step=worker.step,
                   next_token=worker.next_token, phase=worker.spec.phase)
        self.exit(gpu, 0)

    def checkpoint_line(self, gpu: int, retained: bool) -> dict:
        """A checkpoint event as a Ray node hands it to the head: no file here, and whether
        the node could retain its bytes (launcher/supervise/ray/node.py NodeWorker._seen)."""
        worker = self.current(gpu)
        payload = f"gpu{gpu} token{worker.next_token} on a node".encode()
        event = {"type": "event", "event": "checkpoint", "sha256": hashlib.sha256(payload)
                 .hexdigest(), "path": f"checkpoints/fractus_1b_gpu{gpu}.pt",
                 "next_token": worker.next_token, "step": worker.step, "ema_tf": 5.0,
                 "lb": 2.0, "node": worker.node, "retained": retained, "ts": time.time()}
        self.line(worker, event)
        return event

    def event(self, gpu: int, name: str, **fields) -> None:
        self.line(self.current(gpu), {"type": "event", "event": name, **fields})

    def exit(self, gpu: int, code: int, error: str | None = None) -> None:
        """The GPU's worker ended with `code`; `error`: a call of the backend failed on
        its behalf (the backend then killed it)."""
        self._end(self.current(gpu), WorkerExit(code, error=error))

    def lose_node(self, node: str) -> None:
        """The machine is gone: its devices with it, its workers ended."""
        self.free.pop(node, None)
        for worker in self.started:
            if worker.node == node and worker.ended is None:
                worker.ended = WorkerExit(None, node_lost=True)

    def silence_node(self, node: str) -> None:
        """The machine stopped answering: its workers write nothing more, and only killing
        them (as hung) tells that the node is gone."""
        self.free.pop(node, None)
        self.unreachable.add(node)

    def add_node(self, node: str, devices: int) -> None:
        self.free[node] = devices

    def _end(self, worker: FakeWorker, ended: WorkerExit) -> None:
        if worker.ended is None:
            worker.ended = ended
            if worker.node in self.free:
                self.free[worker.node] += 1
