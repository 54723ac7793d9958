"""`RayBackend`: each GPU's worker runs on a node of a Ray cluster; the launcher is the driver.

One actor per GPU (launcher/supervise/ray_node.py) takes one device of a node (`num_gpus=1`
for cuda devices; one CPU, or the configured custom resource, on the CPU demo), spread
over the nodes, and runs the same worker program with the same environment as the local
backend. Ray only places processes: it joins them into no process group (no torchrun).

Once per poll the launcher collects every actor's new metrics lines in one round trip and
appends them to logs/metrics_gpu{i}.jsonl in the pod directory, so checks, verdicts,
rollback and the manifest work exactly as on one machine. This backend runs processes
only; the checkpoints on the nodes (pushes, hub copies, probes on the nodes, the lease) are
`RayCustodian`'s (launcher/supervise/ray_custodian.py), which reaches the actors through
`actor(gpu)`, `node(gpu)` and `on_lost`.

An actor whose process died on a node that is alive is replaced there
(launcher/supervise/ray_adopt.py).

Each GPU's lineage, the worker start its recovery copies carry (`attempt`), is kept in
logs/ray_lineage.json as well as in memory: written when a start answers, cleared when a
start begins anew (unless it continues that lineage: it resumes from that start's recovery
copy) and before a worker is killed (a failed check, a hang: its saves are no resume point).
A launcher killed with -9 leaves it for the next launch of the pod, which resumes each GPU
from that lineage's recovery copy when newer than its manifest entry
(RayCustodian.resume_newer_copies, launcher/supervise/ray_custodian.py).

A node lost (Ray reports the GPU's actor dead: `ActorDiedError`) ends the GPU's worker
with `WorkerExit(node_lost=True)` once the node has fenced itself for certain
(launcher/supervise/ray_fence.py: no heartbeat for `fence_s`, then the worker's grace); the
supervisor then resumes the GPU from its newest passed checkpoint on the hub (the
custodian's `hub_copy`), or from its recovery copy when that is newer (`resume_copy`: every
save is pushed at once, before any probe, by a process on its node:
launcher/supervise/ray_recovery.py), on a node with a free device (`can_place`), or it
waits until a node joins.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from launcher.hub.lease import pod_id
from launcher.hub.by_url import absolute_hub_url
from launcher.pod.events import EventLog
from launcher.config.devices import Slot
from launcher.config.podconfig import PodConfig
from launcher.supervise.backend import WorkerBackend, WorkerExit, WorkerHandle
from launcher.supervise.ray_adopt import NodeAdoption
from launcher.supervise.ray_fence import NAMESPACE, Heartbeat, actor_prefix, end_orphans
from launcher.supervise.ray_node import BytesNowhere, NodeWorker
from launcher.supervise.ray_recovery import is_recovery
from launcher.supervise.ray_recovery_staging import gpu_commit_every_s
from launcher.config.ray_settings import RaySettings
from launcher.worker.process import WorkerSpec, build_env, pod_env_names
from launcher.files import read_json_state, write_json_state
from launcher.paths import RAY_LINEAGE_FILE, worker_log_path
from launcher.hub.redact import describe_error
from launcher.hub.redact import scrub

POLL_WAIT_S = 5.0          # a node slower than this to answer is asked again next poll
# At most one round trip to the nodes every 2 s, whatever the pod's poll_interval_s: each
# call costs the driver CPU, and 2 s of metrics latency changes no decision (hang limits
# are minutes).
ROUND_TRIP_S = 2.0
CALL_TIMEOUT_S = 120.0     # kill / a single stop beyond its grace


@dataclass(eq=False)
class RayHandle(WorkerHandle):
    actor: object = None
    start_ref: object = None          # the actor's start() until it answers
    poll_ref: object = None           # the poll in flight (never dropped: it carries lines)
    ended: WorkerExit | None = None
    lost_after: float | None = None   # Ray reported its actor dead: lost at this time
    node_id: str | None = None        # the node's full id (NodeAffinity for a replacement)
    metrics: str | None = None        # its metrics file, relative to the node's workdir
    read_to: int | None = None        # the byte of that file the launcher has read up to
    adopt_ref: object = None          # a replacement actor on the same node taking over
    adopt_by: float = 0.0             # ... answering by then (monotonic), else: lost
    attempt: str | None = None        # this worker start's id, in its recovery copies
    ckpt_sha256: str | None = None    # the bytes this start resumes from, as its entry records


class RayBackend(NodeAdoption, WorkerBackend):
    name = "ray"

    def __init__(self, pod_dir: Path, config: PodConfig, settings: RaySettings,
                 events: EventLog, gpus: int = 1):
        import ray      # optional (the ray extra): only a launch --ray imports it
        super().__init__(pod_dir)
        self.ray, self.config, self.settings, self.events = ray, config, settings, events
        if not ray.is_initialized():
            ray.init(address=settings.address, namespace=NAMESPACE, log_to_driver=False,
                     logging_level="WARNING", configure_logging=False)
        # The cluster's own messages to every driver (a raylet's death with 20 lines of
        # its `[state-dump]` log, a worker's) printed raw into the launcher's log at each
        # loss; the events say what happened to which GPU (node_unreachable, node_lost).
        # Ray's one switch for it (ray.util.rpdb uses it); the `ray` extra pins Ray.
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
        # Each actor is told the hub and the pod it pushes as (the run's hub lease:
        # launcher/hub/lease.py); what it pushes and when is RayCustodian's.
        self.hub_url = absolute_hub_url(config.hub, pod_dir)
        self.writer = pod_id(pod_dir) if self.hub_url else None
        # Each node fetches its own GPUs' shards from here (the URL and revision only: its
        # credentials are the node's own, as for the hub).
        self.data = {"url": absolute_hub_url(config.data.url, pod_dir),
                     "revision": config.data.revision} if config.data else None
        self.last_round_trip = float("-inf")
        # GPU -> the recorded bytes its node found nowhere at its last start ({sha256,
        # error}), for the custodian's restore before the next (RayCustodian.restore).
        self.bytes_gone: dict[int, dict] = {}
        self.lineage = read_lineage(pod_dir)      # the last launcher's, until a start answers
        self.heartbeat = Heartbeat(ray, self.actors, settings.fence_s, config.stop_grace_s)
        # Each GPU's share of the hub's commit budget for its recovery copies (the pod's
        # `gpus` GPUs share it; launcher/supervise/ray_recovery.py)
        self.recovery_every_s = gpu_commit_every_s(self.hub_url, gpus,
                                                   config.sync_settings().commits_per_hour)

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

    def attempt(self, gpu: int) -> str | None:
        """The id of the GPU's last worker start, which its recovery copies carry (None: no
        start answered yet); a lost GPU's is kept until it starts again. Before this
        launcher started it: the previous launcher's (its lineage file)."""
        handle = self.handles.get(gpu)
        return handle.attempt if handle is not None else self.lineage.get(gpu)

    def take_bytes_gone(self, gpu: int) -> dict | None:
        """The bytes {sha256, error} the GPU's node found nowhere at its last start, once."""
        return self.bytes_gone.pop(gpu, None)

    def _note_lineage(self, gpu: int, attempt: str | None) -> None:
        """Record the GPU's lineage (None: none) durably, before what follows can be lost
        with this launcher."""
        if self.lineage.get(gpu) != attempt:
            if attempt is None:
                self.lineage.pop(gpu, None)
            else:
                self.lineage[gpu] = attempt
            write_lineage(self.pod_dir, self.lineage)

    def log_file(self, gpu: int) -> None:
        return None             # on the worker's node (the head's has only _log's lines)

    def can_place(self, slot: Slot) -> bool:
        name, _ = self._resource(slot)
        return self.ray.available_resources().get(name, 0) >= 1

    def _new_actor(self, slot: Slot, node_id: str | None = None):
        """The GPU's actor: spread over the nodes, or on `node_id` (a replacement)."""
        _, options = self._resource(slot)
        strategy = "SPREAD"
        if node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # optional
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return self.actor_class.options(
            # poll, push, an AR probe, a stop and a heartbeat can all be in flight at once
            scheduling_strategy=strategy, max_concurrency=5, max_restarts=0,
            # outlives a launcher killed with -9 until it fences (its worker's final
            # save); named, so that the next launcher of this pod finds it
            lifetime="detached",
            name=f"{self.actor_prefix}gpu{slot.gpu}-{uuid.uuid4().hex[:8]}",
            **options).remote(slot.gpu, self.settings.workdir, str(self.pod_dir.resolve()),
                              self.hub_url, self.writer, list(self.config.worker),
                              self.settings.fence_s, self.config.stop_grace_s, self.data,
                              self.recovery_every_s)

    def start(self, spec: WorkerSpec) -> RayHandle:
        gpu = spec.slot.gpu
        self.slots[gpu] = spec.slot
        actor = self.actors.get(gpu)
        if actor is None:              # first start, or its node was lost: a new actor
            actor = self.actors[gpu] = self._new_actor(spec.slot)
        checkpoint = ({"path": spec.ckpt_in, "sha256": spec.ckpt_sha256,
                       "revision": spec.ckpt_revision} if spec.ckpt_in else None)
        handle = RayHandle(gpu, None, None, actor=actor, ckpt_sha256=spec.ckpt_sha256,
                           attempt=self._continued_attempt(gpu, spec.ckpt_in))
        self._note_lineage(gpu, handle.attempt)
        settings = build_env(self.config, spec, base={})
        handle.metrics = settings["METRICS"]
        # The shards of its data phase and every later one (a phase switch starts the next
        # phase's worker with them already there).
        shards = self.config.shard_paths(gpu)[spec.phase - 1:] if self.data else []
        handle.start_ref = actor.start.remote(settings, checkpoint, spec.slot.device == "cuda",
                                              sorted(pod_env_names(self.config)), shards,
                                              spec.start_over)
        self.handles[gpu] = handle
        return handle

    def _continued_attempt(self, gpu: int, ckpt_in: str | None) -> str | None:
        """The attempt a new start of `gpu` goes on from until it answers with its own: the
        previous start's, when this one resumes from that start's recovery copy. Its node
        can be lost before the start answers (a node going away as it is placed); the GPU
        then resumes from that same copy again, not from its older passed one (issue 16
        item 30). Any other start (a rollback, a restart from a passed copy) carries none:
        an older lineage's copies must never serve."""
        if not ckpt_in or not is_recovery(ckpt_in):
            return None
        return self.attempt(gpu)      # a relaunch's first start: the previous launcher's

    # ---- monitoring ----------------------------------------------------------------------
    def pump(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_round_trip < ROUND_TRIP_S:
            return
        self.last_round_trip = time.monotonic()
        for handle in [h for h in self.handles.values() if h.lost_after and not h.ended]:
            self._lost(handle)          # declared lost once its node has fenced itself
        for handle in [h for h in self.handles.values() if h.adopt_ref is not None]:
            self._adopted(handle, timeout=0)
        live = [h for h in self.handles.values()
                if h.ended is None and h.lost_after is None and h.adopt_ref is None]
        self._placed([h for h in live if h.start_ref is not None])
        for handle in live:
            if handle.start_ref is None and handle.ended is None and handle.poll_ref is None:
                handle.poll_ref = handle.actor.poll.remote()
        in_flight = [h.poll_ref for h in live if h.poll_ref is not None]
        if in_flight:
            ready, _ = self.ray.wait(in_flight, num_returns=len(in_flight),
                                     timeout=POLL_WAIT_S)
            ready = set(ready)
            answered = [h for h in live if h.poll_ref is not None and h.poll_ref in ready]
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
        ready, _ = self.ray.wait([h.start_ref for h in starting], num_returns=len(starting),
                                 timeout=0)
        ready = set(ready)
        for handle in starting:
            if handle.start_ref not in ready:
                continue
            ref, handle.start_ref = handle.start_ref, None
            try:
                info = self.ray.get(ref)
            except self.ray.exceptions.RayActorError:
                self._lost(handle)
                continue
            except self.ray.exceptions.RayError as exc:
                error = remote_error(exc)
                if isinstance(getattr(exc, "cause", None), BytesNowhere):
                    self.bytes_gone[handle.gpu] = {"sha256": handle.ckpt_sha256,
                                                   "error": str(exc.cause)}
                self.events.emit("worker_start_failed", gpu=handle.gpu, error=error)
                self._log(handle.gpu, f"worker start failed on its node: {exc}")
                handle.ended = WorkerExit(1, error=error)
                continue
            handle.pid, handle.node, handle.node_id = info["pid"], info["node"], info["node_id"]
            handle.attempt = info.get("attempt")
            self._note_lineage(handle.gpu, handle.attempt)
            self.heartbeat.heard(handle.actor)
            self.events.emit("worker_placed", gpu=handle.gpu, node=info["node"],
                             pid=info["pid"], workdir=info["workdir"])
            if info.get("recovered"):
                self.events.emit("checkpoint_recovered", gpu=handle.gpu, node=info["node"],
                                 checkpoint=info["recovered"],
                                 reason="the named file on its node held other bytes than "
                                        "its manifest entry records; the worker resumed "
                                        "from the node's copy of those")
            if info.get("set_aside"):
                self.events.emit("checkpoint_set_aside", gpu=handle.gpu, node=info["node"],
                                 set_aside=info["set_aside"],
                                 reason="it starts over at token 0 and nothing it wrote "
                                        "passed: its files on its node renamed NAME.failed")
            if info["fetched"]:
                self.events.emit("shards_fetched", gpu=handle.gpu, node=info["node"],
                                 shards=info["fetched"],
                                 reason="its node lacked the shards it trains on")
            if info["pulled"]:
                self.events.emit("checkpoint_pulled", gpu=handle.gpu, node=info["node"],
                                 reason="its node lacked the checkpoint it resumes from")

    def _take(self, handle: RayHandle, ref, answer: tuple | None = None) -> WorkerExit | None:
        """Apply one answer of the actor, (exit code, lines); a dead actor is a lost node,
        a call that raised on the node a crashed worker."""
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
            handle.ended = WorkerExit(code)
        return handle.ended

    def _append_lines(self, gpu: int, lines: bytes) -> None:
        if lines:
            self.heartbeat.measured.note_lines(gpu, lines)    # the fence's step/save times
            path = self.metrics_file(gpu)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as f:
                f.write(lines)

    def _failed(self, handle: RayHandle, exc: Exception) -> WorkerExit:
        """A call on the GPU's node raised (a bug, a file gone under it): never the
        launcher's end. The node's worker is killed first (a restart must not race a live
        one; an actor that cannot even do that is replaced at the next start), the error
        goes to the events and to the GPU's log on the head, and the GPU ends as a crashed
        worker: the supervisor's restart policy takes it from there."""
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
        handle.ended = WorkerExit(code if code not in (None, 0) else -9, error=error)
        return handle.ended

    def _log(self, gpu: int, text: str) -> None:
        """A line for the GPU's log on the head (the worker's own log is on its node)."""
        path = self.pod_dir / worker_log_path(gpu)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            log.write(f"[fractus-pod {time.strftime('%Y-%m-%d %H:%M:%S')}] {scrub(text)}\n")

    def _lost(self, handle: RayHandle, wait: bool = False) -> WorkerExit | None:
        """Ray reported the GPU's actor dead. Its node may only be cut off (a partition, a
        stopped raylet) with its worker still training: the GPU is declared lost once that
        node has fenced itself for certain (Heartbeat.lost_after), not before; `wait`: block
        until then (a stop or kill must return an exit, and a rollback or a hang's restart
        would otherwise place the GPU again while the node may still train it)."""
        if handle.lost_after is None and handle.adopt_ref is None and self._replace(handle):
            if wait:                    # its node lives: a new actor there takes over
                self._adopted(handle, timeout=None)
            return handle.ended
        if handle.lost_after is None:
            handle.lost_after = self.heartbeat.lost_after(handle.actor)
            self.actors.pop(handle.gpu, None)
            for forget in self.on_lost:
                forget(handle.gpu)
            within = max(0.0, handle.lost_after - time.monotonic())
            self.events.emit("node_unreachable", gpu=handle.gpu, node=handle.node,
                             fenced_within_s=round(within, 1),
                             reason="Ray reports its actor dead; the GPU is placed again "
                                    "once its node has stopped the worker for certain")
        if wait:
            time.sleep(max(0.0, handle.lost_after - time.monotonic()))
        if time.monotonic() >= handle.lost_after:
            handle.ended = WorkerExit(None, node_lost=True)
        return handle.ended

    def poll(self, handle: RayHandle) -> WorkerExit | None:
        return handle.ended

    def settling(self, handle: RayHandle) -> bool:
        # An adoption answers by adopt_by, a fenced node's GPU is lost at lost_after.
        return handle.ended is None and (handle.adopt_ref is not None
                                         or handle.lost_after is not None)

    def signal(self, handle: RayHandle, signum: int) -> None:
        if handle.ended is None:
            handle.actor.signal.remote(signum)

    def _finish(self, handles: list[RayHandle], call,
                answer_s: float = CALL_TIMEOUT_S) -> dict[int, WorkerExit]:
        """Collect the polls in flight (their lines), then `call(actor)` on each, which
        returns (exit code, its last lines) within `answer_s`."""
        for handle in handles:
            if handle.adopt_ref is not None:
                self._adopted(handle, timeout=None)
            if handle.lost_after is not None and handle.ended is None:
                self._lost(handle, wait=True)
            if handle.poll_ref is not None:
                ref, handle.poll_ref = handle.poll_ref, None
                self._answer(handle, ref, CALL_TIMEOUT_S)
        refs = {h.gpu: call(h.actor) for h in handles
                if h.ended is None and h.start_ref is None}
        for handle in handles:
            if handle.start_ref is not None:        # never answered: its node is gone
                ready, _ = self.ray.wait([handle.start_ref], timeout=CALL_TIMEOUT_S)
                if ready:
                    self._placed([handle])
                else:
                    self._lost(handle, wait=True)
                if handle.ended is None:
                    refs[handle.gpu] = call(handle.actor)
        for handle in handles:
            if handle.gpu in refs and handle.ended is None:
                self._answer(handle, refs[handle.gpu], answer_s)
                if handle.lost_after is not None:
                    self._lost(handle, wait=True)
            if handle.ended is None:
                handle.ended = WorkerExit(-9)
        return {h.gpu: h.ended for h in handles}

    def kill(self, handle: RayHandle) -> WorkerExit:
        # A killed worker (a failed check, a hang) ends its lineage: no relaunch resumes
        # from its recovery copies.
        self._note_lineage(handle.gpu, None)
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


def read_lineage(pod_dir: Path) -> dict[int, str]:
    """GPU -> the worker start whose recovery copies continue its manifest entry, as the
    last launcher recorded it (logs/ray_lineage.json; anything else in it is ignored)."""
    state = read_json_state(pod_dir / RAY_LINEAGE_FILE)
    return {int(gpu): attempt for gpu, attempt in state.items()
            if gpu.isdigit() and isinstance(attempt, str) and attempt}


def write_lineage(pod_dir: Path, lineage: dict[int, str]) -> None:
    write_json_state(pod_dir / RAY_LINEAGE_FILE, {str(g): a for g, a in lineage.items()})


def remote_error(exc: Exception) -> str:
    """One line for the events: the exception raised on the node (a RayTaskError carries
    it as `cause`), without its traceback, scrubbed of any token."""
    cause = getattr(exc, "cause", None)
    if cause is None:
        return describe_error(exc)
    kind = type(exc).__name__.split("(")[0]    # Ray names it RayTaskError(FileNotFoundError)
    return f"{kind}({describe_error(cause)})"[:500]


