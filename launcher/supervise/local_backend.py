"""`LocalBackend`: the workers as child processes through launcher/child.py (`python -P`, a
scrubbed environment, SIGTERM when the launcher dies), writing the pod's logs/ directly."""

from __future__ import annotations

import subprocess

from launcher.worker import process as workers
from launcher.config.podconfig import PodConfig
from launcher.supervise.backend import WorkerBackend, WorkerExit, WorkerHandle
from launcher.worker.process import WorkerSpec


class LocalHandle(WorkerHandle):
    def __init__(self, gpu: int, proc: subprocess.Popen):
        super().__init__(gpu, proc.pid, None)
        self.proc = proc


class LocalBackend(WorkerBackend):
    name = "local"

    def __init__(self, pod_dir, config: PodConfig):
        super().__init__(pod_dir)
        self.config = config

    def start(self, spec: WorkerSpec) -> LocalHandle:
        return LocalHandle(spec.slot.gpu, workers.spawn_worker(self.config, self.pod_dir, spec))

    def poll(self, handle: LocalHandle) -> WorkerExit | None:
        code = handle.proc.poll()
        return None if code is None else WorkerExit(code)

    def signal(self, handle: LocalHandle, signum: int) -> None:
        try:
            handle.proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def kill(self, handle: LocalHandle) -> WorkerExit:
        workers.kill(handle.proc)
        return WorkerExit(handle.proc.returncode)

    def stop(self, handles: list[LocalHandle], grace_s: float) -> dict[int, WorkerExit]:
        workers.terminate([h.proc for h in handles], grace_s)
        return {h.gpu: WorkerExit(h.proc.returncode) for h in handles}
