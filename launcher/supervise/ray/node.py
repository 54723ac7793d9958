"""The Ray actor of one GPU on a node (`NodeWorker`): the calls the launcher makes there.

Invariant: the actor only composes `ProcessHost` (the worker and its fence) and
`NodeCheckpoints`; it imports nothing of Ray at module level. Owner: RayBackend, one per GPU.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from launcher.paths import worker_log_path
from launcher.supervise.ray.node_checkpoints import NodeCheckpoints
from launcher.supervise.ray.node_process import ProcessHost
from launcher.worker.process import worker_env

# Resolved by NodeCheckpoints.input: shards (without `data:`) and a model are the user's to place.
NODE_LOCAL_INPUTS = ("SHARD", "MODEL")


class NodeWorker:
    def __init__(self, gpu: int, workdir: str, pod_dir: str, hub_url: str | None,
                 writer: str | None, command: list[str], fence_s: float, grace_s: float,
                 data: dict | None = None, recovery_every_s: float = 0.0):
        import ray      # optional (the ray extra): only a launch --ray imports it
        self.node_id = ray.get_runtime_context().get_node_id()   # for NodeAffinity
        self.node, self.gpu = self.node_id[:12], gpu
        self.workdir = Path(workdir.format(node=self.node, pod=pod_dir))
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.ckpts = NodeCheckpoints(gpu, self.node, self.workdir, Path(pod_dir), hub_url,
                                     writer, data, recovery_every_s)
        self.host = ProcessHost(gpu, self.workdir, command, fence_s, grace_s,
                                self.ckpts.seen)

    def start(self, settings: dict[str, str], checkpoint: dict | None, cuda: bool,
              keep: list[str] = (), shards: list[str] = (), start_over: bool = False) -> dict:
        """Start the worker once `shards` (pod-relative) and `checkpoint` ({"path", "sha256",
        "revision"}) are in place (NodeCheckpoints.prepare)."""
        try:
            return self._start(settings, checkpoint, cuda, keep, shards, start_over)
        finally:
            self.ckpts.placed.set()   # a probe waiting for the start goes on, whatever it did

    def _start(self, settings: dict[str, str], checkpoint: dict | None, cuda: bool,
               keep: list[str], shards: list[str], start_over: bool) -> dict:
        import ray      # optional, as above
        self.host.heard = time.monotonic()
        settings, info = self.ckpts.prepare(settings, checkpoint, shards, start_over,
                                            self.host.note)
        env = worker_env(os.environ, settings, keep=keep)
        for name in NODE_LOCAL_INPUTS:
            if env.get(name):
                env[name] = self.ckpts.input(env[name])
        if cuda:       # the device Ray gave this actor, not the GPU's index on the head
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(int(i)) for i in ray.get_gpu_ids())
        offset = self.host.spawn(env, keep, settings["METRICS"])
        pid = self.host.proc.pid
        attempt = self.ckpts.start_recovery_pushes(pid, settings, offset,
                                                   self.workdir / worker_log_path(self.gpu))
        return {"pid": pid, "node": self.node, "node_id": self.node_id,
                "workdir": str(self.workdir), "attempt": attempt, **info}

    def heartbeat(self, fence_s: float | None = None, grace_s: float | None = None) -> None:
        self.host.heartbeat(fence_s, grace_s)

    def poll(self) -> tuple[int | None, bytes, int]:
        return self.host.poll()

    def adopt(self, pid: int, metrics: str, offset: int) -> tuple[int | None, bytes]:
        return self.host.adopt(pid, metrics, offset)

    def signal(self, signum: int) -> None:
        self.host.signal(signum)

    def kill(self) -> tuple[int | None, bytes]:
        return self.host.kill()

    def terminate(self, grace_s: float) -> tuple[int | None, bytes]:
        return self.host.terminate(grace_s)

    def probe(self, checkpoint: str, shard: str, **options) -> dict:
        return self.ckpts.probe(checkpoint, shard, **options)

    def push(self, sha256: str, hub_path: str, message: str) -> str:
        return self.ckpts.push(sha256, hub_path, message)
