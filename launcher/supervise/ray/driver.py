"""`RayBackend`: each GPU's worker runs on a node of a Ray cluster; the launcher is the driver.

Invariant: never two workers of one GPU. Owner: RayBackend. One detached actor per GPU
(node.py) runs the local backend's worker program on a node; each round trip appends its new
metrics lines to logs/metrics_gpu{i}.jsonl, so checks, verdicts and rollback work as on one
machine. A dead actor on a live node is adopted (adoption.py), else its GPU is lost once its
node fenced itself for certain (fence.py).
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from typing import Callable

from launcher.config.devices import Slot
from launcher.config.podconfig import PodConfig
from launcher.config.ray_settings import RaySettings
from launcher.hub.redact import describe_error, scrub
from launcher.paths import worker_log_path
from launcher.pod.events import EventLog
from launcher.supervise.backend import WorkerBackend, WorkerExit
from launcher.supervise.ray.adoption import AdoptionFailed, NodeAdoption
from launcher.supervise.ray.fence import NAMESPACE, Heartbeat, actor_prefix, end_orphans
from launcher.supervise.ray.handle import RayEvent, RayHandle, RayState
from launcher.supervise.ray.node import NodeWorker
from launcher.supervise.ray.node_checkpoints import BytesNowhere
from launcher.supervise.ray.starts import GpuStarts
from launcher.worker.process import WorkerSpec, build_env, pod_env_names

POLL_WAIT_S = 5.0          # a node slower than this to answer is asked again next poll
# Whatever poll_interval_s: each call costs driver CPU; 2 s of latency changes no decision.
ROUND_TRIP_S = 2.0
CALL_TIMEOUT_S = 120.0     # kill / a single stop beyond its grace
ANSWER_CHECK_S = 1.0       # how often a wait for a kill's answer looks at the heartbeats


class RayBackend(WorkerBackend):
    name = "ray"

    def __init__(self, pod_dir: Path, config: PodConfig, settings: RaySettings,
                 events: EventLog, starts: GpuStarts):
        import ray      # optional (the ray extra): only a launch --ray imports it
        super().__init__(pod_dir)
        self.ray, self.config, self.settings, self.events = ray, config, settings, events
        self.starts = starts
        if not ray.is_initialized():
            ray.init(address=settings.address, namespace=NAMESPACE, log_to_driver=False,
                     logging_level="WARNING", configure_logging=False)
        # The cluster's messages to every driver (a raylet's state dump) would go raw into
        # the log. Ray's one switch for it (ray.util.rpdb uses it); the `ray` extra pins Ray.
        ray._private.worker._worker_logs_enabled = False
        self.actor_class = ray.remote(NodeWorker)
        self.actor_prefix = actor_prefix(pod_dir)
        for orphan in end_orphans(ray, self.actor_prefix, config.stop_grace_s,
                                  config.stop_grace_s + CALL_TIMEOUT_S):
            events.emit("orphan_stopped", **orphan,
                        reason="a node actor of this pod's previous launcher, still running: "
                               "stopped (its worker saved) before any worker starts")
        self.handles: dict[int, RayHandle] = {}
        self.actors: dict[int, object] = {}
        self.slots: dict[int, Slot] = {}
        # Told the GPU whose node was lost (the custodian drops its push not sent yet).
        self.on_lost: list[Callable[[int], None]] = []
        self.last_round_trip = float("-inf")
        self.heartbeat = Heartbeat(ray, self.actors, settings.fence_s, config.stop_grace_s)
        self.adoption = NodeAdoption(ray, self.heartbeat, config.stop_grace_s,
                                     lambda gpu, node_id: self._new_actor(self.slots[gpu],
                                                                          node_id))

    # ---- placement ---------------------------------------------------------------------
    def _resource(self, slot: Slot) -> tuple[str, dict]:
        if self.settings.resource:
            return self.settings.resource, {"num_cpus": 0,
                                            "resources": {self.settings.resource: 1}}
        if slot.device == "cuda":
            return "GPU", {"num_gpus": 1, "num_cpus": 0}
        return "CPU", {"num_cpus": 1}

    def actor(self, gpu: int):
        """The GPU's actor now (None: none, its node was lost), for the custodian's calls."""
        return self.actors.get(gpu)

    def node(self, gpu: int) -> str | None:
        """The name of the node the GPU's worker was placed on (None: not placed yet)."""
        handle = self.handles.get(gpu)
        return handle.node if handle is not None else None

    def log_file(self, gpu: int) -> None:
        return None             # on the worker's node (the head's has only _log's lines)

    def can_place(self, slot: Slot) -> bool:
        name, _ = self._resource(slot)
        return self.ray.available_resources().get(name, 0) >= 1

    def _new_actor(self, slot: Slot, node_id: str | None = None):
        """A new actor for the GPU: spread over the nodes, or on `node_id` (a replacement)."""
        _, options = self._resource(slot)
        strategy = "SPREAD"
        if node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # optional
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        self.actors[slot.gpu] = self.actor_class.options(
            # poll, push, an AR probe, a stop and a heartbeat can all be in flight at once
            scheduling_strategy=strategy, max_concurrency=5, max_restarts=0,
            # outlives a launcher killed with -9 until it fences; named for the next launcher
            lifetime="detached",
            name=f"{self.actor_prefix}gpu{slot.gpu}-{uuid.uuid4().hex[:8]}",
            **options).remote(slot.gpu, self.settings.workdir, str(self.pod_dir.resolve()),
                              command=list(self.config.worker), fence_s=self.settings.fence_s,
                              grace_s=self.config.stop_grace_s, **self.starts.node_args)
        return self.actors[slot.gpu]

    def start(self, spec: WorkerSpec) -> RayHandle:
        gpu = spec.slot.gpu
        self.slots[gpu] = spec.slot
        # first start, or its node was lost: a new actor
        actor = self.actors.get(gpu) or self._new_actor(spec.slot)
        checkpoint = ({"path": spec.ckpt_in, "sha256": spec.ckpt_sha256,
                       "revision": spec.ckpt_revision} if spec.ckpt_in else None)
        self.starts.starting(gpu, spec.ckpt_in)
        settings = build_env(self.config, spec, base={})
        handle = RayHandle(gpu, None, None, actor=actor, ckpt_sha256=spec.ckpt_sha256,
                           metrics=settings["METRICS"])
        # this phase's shards and every later one's (a phase switch finds them there)
        shards = self.config.shard_paths(gpu)[spec.phase - 1:] if self.config.data else []
        handle.call = actor.start.remote(settings, checkpoint, spec.slot.device == "cuda",
                                         sorted(pod_env_names(self.config)), shards,
                                         spec.start_over)
        self.handles[gpu] = handle
        return handle

    # ---- monitoring ----------------------------------------------------------------------
    def _in(self, *states: RayState) -> list[RayHandle]:
        return [h for h in self.handles.values() if h.state in states]

    def pump(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_round_trip < ROUND_TRIP_S:
            return
        self.last_round_trip = time.monotonic()
        for handle in self._in(RayState.FENCING):
            self._lost(handle)          # declared lost once its node has fenced itself
        for handle in self._in(RayState.ADOPTING):
            self._adopted(handle, timeout=0)
        self._placed(self._in(RayState.PLACING))
        running = self._in(RayState.RUNNING)
        for handle in running:
            if handle.poll_ref is None:
                handle.poll_ref = handle.actor.poll.remote()
        if running:
            ready, _ = self.ray.wait([h.poll_ref for h in running], num_returns=len(running),
                                     timeout=POLL_WAIT_S)
            ready = set(ready)
            answered = [h for h in running if h.poll_ref in ready]
            try:             # one fetch for all answers: the common case, no call failed
                answers = self.ray.get([h.poll_ref for h in answered])
            except self.ray.exceptions.RayError:
                answers = [None] * len(answered)        # fetched one by one below
            for handle, answer in zip(answered, answers):
                ref, handle.poll_ref = handle.poll_ref, None
                self._take(handle, ref, answer)

    def _placed(self, starting: list[RayHandle]) -> None:
        if not starting:
            return
        ready, _ = self.ray.wait([h.call for h in starting], num_returns=len(starting),
                                 timeout=0)
        for handle in [h for h in starting if h.call in set(ready)]:
            try:
                info = self.ray.get(handle.call)
            except self.ray.exceptions.RayActorError:
                self._lost(handle)
                continue
            except self.ray.exceptions.RayError as exc:
                error = remote_error(exc)
                if isinstance(getattr(exc, "cause", None), BytesNowhere):
                    self.starts.nowhere(handle.gpu, handle.ckpt_sha256, str(exc.cause))
                self.events.emit("worker_start_failed", gpu=handle.gpu, error=error)
                self._log(handle.gpu, f"worker start failed on its node: {exc}")
                handle.move(RayEvent.EXITED, WorkerExit(1, error=error))
                continue
            handle.move(RayEvent.PLACED)
            handle.pid, handle.node, handle.node_id = info["pid"], info["node"], info["node_id"]
            self.starts.started(handle.gpu, info.get("attempt"))
            self.heartbeat.heard(handle.actor)
            self._placed_events(handle.gpu, info)

    def _placed_events(self, gpu: int, info: dict) -> None:
        node = info["node"]
        self.events.emit("worker_placed", gpu=gpu, node=node, pid=info["pid"],
                         workdir=info["workdir"])
        if info.get("recovered"):
            self.events.emit("checkpoint_recovered", gpu=gpu, node=node,
                             checkpoint=info["recovered"],
                             reason="the named file on its node held other bytes than its "
                                    "manifest entry records; the worker resumed from the "
                                    "node's copy of those")
        if info.get("set_aside"):
            self.events.emit("checkpoint_set_aside", gpu=gpu, node=node,
                             set_aside=info["set_aside"],
                             reason="it starts over at token 0 and nothing it wrote passed: "
                                    "its files on its node renamed NAME.failed")
        if info["fetched"]:
            self.events.emit("shards_fetched", gpu=gpu, node=node, shards=info["fetched"],
                             reason="its node lacked the shards it trains on")
        if info["pulled"]:
            self.events.emit("checkpoint_pulled", gpu=gpu, node=node,
                             reason="its node lacked the checkpoint it resumes from")

    def _take(self, handle: RayHandle, ref, answer: tuple | None = None) -> None:
        """Apply one answer, (exit code, lines[, read_to])."""
        try:
            code, lines, *read_to = answer if answer is not None else self.ray.get(ref)
        except self.ray.exceptions.RayActorError:
            return self._lost(handle)
        except self.ray.exceptions.RayError as exc:
            return self._failed(handle, exc)
        self._append_lines(handle.gpu, lines)
        if read_to:                      # a poll's answer: where the next reader goes on
            handle.read_to = read_to[0]
        if code is not None:
            handle.move(RayEvent.EXITED, WorkerExit(code))

    def _append_lines(self, gpu: int, lines: bytes) -> None:
        if lines:
            self.heartbeat.measured.note_lines(gpu, lines)    # the fence's step/save times
            path = self.metrics_file(gpu)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as f:
                f.write(lines)

    def _failed(self, handle: RayHandle, exc: Exception) -> None:
        """A call on the GPU's node raised: the worker is killed first (a restart must not
        race it) and the GPU ends as a crashed worker, never the launcher."""
        error = remote_error(exc)
        code = None
        try:
            code, lines = self.ray.get(handle.actor.kill.remote(), timeout=CALL_TIMEOUT_S)
            self._append_lines(handle.gpu, lines)
        except self.ray.exceptions.RayError:
            self.ray.kill(handle.actor)
            self.actors.pop(handle.gpu, None)
        self.events.emit("node_error", gpu=handle.gpu, node=handle.node, error=error,
                         action="worker killed; restarted as after a crash")
        self._log(handle.gpu, f"a call on node {handle.node} failed; worker killed: {exc}")
        handle.move(RayEvent.EXITED, WorkerExit(code if code not in (None, 0) else -9,
                                                error=error))

    def _log(self, gpu: int, text: str) -> None:
        """A line for the GPU's log on the head (the worker's own log is on its node)."""
        path = self.pod_dir / worker_log_path(gpu)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            log.write(f"[fractus-pod {time.strftime('%Y-%m-%d %H:%M:%S')}] {scrub(text)}\n")

    def _lost(self, handle: RayHandle, wait: bool = False) -> None:
        """Ray reported the GPU's actor dead: a new actor adopts it on a live node; else the
        GPU is lost once its node has fenced itself for certain (Heartbeat.lost_after).
        `wait`: block until then (a stop or kill must return an exit)."""
        if handle.state is RayState.RUNNING and self.adoption.begin(handle):
            self.events.emit("actor_died", gpu=handle.gpu, node=handle.node, pid=handle.pid,
                             reason="its actor's process died on a live node: a new actor on "
                                    "that node takes over once the worker's final save ended")
            if wait:
                self._adopted(handle, timeout=None)
            return
        if handle.state in (RayState.PLACING, RayState.RUNNING, RayState.ADOPTING):
            handle.move(RayEvent.DIED)
            handle.deadline = self.heartbeat.lost_after(handle.actor)
            self.actors.pop(handle.gpu, None)
            for forget in self.on_lost:
                forget(handle.gpu)
            self.events.emit("node_unreachable", gpu=handle.gpu, node=handle.node,
                             fenced_within_s=round(max(0.0, handle.deadline
                                                       - time.monotonic()), 1),
                             reason="Ray reports its actor dead; the GPU is placed again "
                                    "once its node has stopped the worker for certain")
        if handle.state is not RayState.FENCING:
            return
        if wait:
            time.sleep(max(0.0, handle.deadline - time.monotonic()))
        if time.monotonic() >= handle.deadline:
            handle.move(RayEvent.FENCED, WorkerExit(None, node_lost=True))

    def _adopted(self, handle: RayHandle, timeout: float | None) -> None:
        """The replacement's answer: the GPU ends as a crashed worker (failed: lost)."""
        try:
            lines = self.adoption.collect(handle, timeout)
        except AdoptionFailed:
            return self._lost(handle)
        if lines is None:
            return
        self._append_lines(handle.gpu, lines)
        error = (f"its actor's process died on node {handle.node}, which is alive; the "
                 f"worker's final save ended there")
        self._log(handle.gpu, error)
        handle.move(RayEvent.ADOPTED, WorkerExit(-signal.SIGTERM, error=error))

    def _answer(self, handle: RayHandle, ref, timeout_s: float) -> None:
        """`_take` of a call the launcher cannot go on without (a kill, a stop, the poll
        before them). An actor silent for `timeout_s` (or to the heartbeats) would block
        every GPU: it is killed and treated as dead (`_lost`)."""
        start = time.monotonic()
        while True:
            ready, _ = self.ray.wait([ref], timeout=ANSWER_CHECK_S)
            if ready:
                return self._take(handle, ref)
            waited = time.monotonic() - start
            if waited >= timeout_s or self.heartbeat.unresponsive(handle.actor):
                break
        self.events.emit("node_unresponsive", gpu=handle.gpu, node=handle.node,
                         waited_s=round(waited, 1),
                         action="its actor killed; the GPU is taken over as after an "
                                "actor's death")
        self._log(handle.gpu, f"the actor on node {handle.node} did not answer in "
                              f"{waited:.0f}s; killed")
        self.ray.kill(handle.actor)
        self._lost(handle, wait=True)

    def poll(self, handle: RayHandle) -> WorkerExit | None:
        return handle.ended

    def settling(self, handle: RayHandle) -> bool:
        # An adoption answers by its deadline, a fenced node's GPU is lost at its deadline.
        return handle.state in (RayState.ADOPTING, RayState.FENCING)

    def signal(self, handle: RayHandle, signum: int) -> None:
        if not handle.done:
            handle.actor.signal.remote(signum)

    def _finish(self, handles: list[RayHandle], call,
                answer_s: float = CALL_TIMEOUT_S) -> dict[int, WorkerExit]:
        """Settle each handle (adoption, fence, poll in flight), then `call(actor)` on each
        running one, answering (exit code, last lines) within `answer_s`; what has no exit
        then ended with -9."""
        for handle in handles:
            if handle.state is RayState.ADOPTING:
                self._adopted(handle, timeout=None)
            if handle.state is RayState.FENCING:
                self._lost(handle, wait=True)
            if handle.state is RayState.RUNNING and handle.poll_ref is not None:
                ref, handle.poll_ref = handle.poll_ref, None
                self._answer(handle, ref, CALL_TIMEOUT_S)
        refs = {h.gpu: call(h.actor) for h in handles if h.state is RayState.RUNNING}
        for handle in [h for h in handles if h.state is RayState.PLACING]:
            ready, _ = self.ray.wait([handle.call], timeout=CALL_TIMEOUT_S)
            if ready:                            # else never answered: its node is gone
                self._placed([handle])
            if handle.state is RayState.RUNNING:
                refs[handle.gpu] = call(handle.actor)
        for handle in handles:
            if handle.gpu in refs and handle.state is RayState.RUNNING:
                self._answer(handle, refs[handle.gpu], answer_s)
            if handle.state in (RayState.PLACING, RayState.FENCING):
                self._lost(handle, wait=True)
            if handle.state is RayState.RUNNING:
                handle.move(RayEvent.EXITED, WorkerExit(-9))
        return {h.gpu: h.ended for h in handles}

    def kill(self, handle: RayHandle) -> WorkerExit:
        # a killed worker ends its lineage: no relaunch resumes from its recovery copies
        self.starts.killed(handle.gpu)
        return self._finish([handle], lambda actor: actor.kill.remote())[handle.gpu]

    def stop(self, handles: list[RayHandle], grace_s: float) -> dict[int, WorkerExit]:
        return self._finish(handles, lambda actor: actor.terminate.remote(grace_s),
                            answer_s=grace_s + CALL_TIMEOUT_S)

    def close(self) -> None:
        """The actors go (after the custodian's last pushes) and the driver disconnects."""
        self.heartbeat.close()
        for actor in self.actors.values():
            self.ray.kill(actor)
        self.actors.clear()
        self.ray.shutdown()


def remote_error(exc: Exception) -> str:
    """One scrubbed line, no traceback: the exception raised on the node (its `cause`)."""
    cause = getattr(exc, "cause", None)
    if cause is None:
        return describe_error(exc)
    kind = type(exc).__name__.split("(")[0]    # Ray names it RayTaskError(FileNotFoundError)
    return f"{kind}({describe_error(cause)})"[:500]
