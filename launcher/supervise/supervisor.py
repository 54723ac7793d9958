"""The pod supervisor: one worker per GPU, health checks, restarts, hang detection, rollback.

A single-threaded poll loop (every `poll_interval_s`), TorchElastic's agent read top to
bottom: run (start every worker), then each turn monitor (read each worker's new metrics
and events into health, checkpoint index and manifest), react (an exit, a hang or a lost
node, each to its handler), restart (a crash's backoff is over, a lost GPU has a node), then
judge the pod (roll back, stop, done) and write logs/pod_state.json for `status`. Decisions
go to logs/events.jsonl before they act.

Processes are the WorkerBackend's (backend.py); a checkpoint once written, and the hub
lease, the CheckpointCustodian's (custodian.py). The jobs are components sharing one PodRun
(launcher/supervise/pod_run.py):
WorkerMonitor (monitor.py), WorkerStarter (starter.py), WorkerRestarter (restart.py),
NodePlacement (placement.py), ExitHandlers (exits.py), StageRollback (rollback.py),
PodEnding (ending.py), FinalVerdicts (final_verdicts.py), PodView (pod_view.py), DiskWatch
(disk_watch.py: `disk_low` before the disk is full).

Hub sync (issue 5, launcher/hub/sync.py): with a `hub:` configured, every poll gives the sync
policy a tick (it pushes in a background thread, never blocking this loop), and when the
loop ends the last push is made before the launcher exits, after a clean end's judgement
of each GPU's last checkpoint, whatever ended the run.

AR probe (issue 6, launcher/checks/probe_monitor.py): with `probe.every` > 0 in the criteria, new
checkpoints are probed in background processes; each poll collects finished probes, and a
Failed one fails its GPU's stage like any other check. The pod is not done while a probe runs.
"""

from __future__ import annotations

import signal
import time

from fractus.train.disk import disk_full
from launcher.checks.probe_monitor import ProbeMonitor
from launcher.errors import UserError, install_hint
from launcher.files import dir_id
from launcher.hub.sync import HubSync
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest
from launcher.pod.reserve import DiskReserve
from launcher.supervise.backend import WorkerBackend
from launcher.supervise.custodian import CheckpointCustodian, LocalCustodian
from launcher.supervise.disk_watch import DiskWatch
from launcher.supervise.ending import LOGS_MOVED, PodEnding
from launcher.supervise.exits import ExitHandlers
from launcher.supervise.final_verdicts import FinalVerdicts
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.monitor import WorkerMonitor
from launcher.supervise.tracker_sink import TrackerSink
from launcher.supervise.placement import NodePlacement
from launcher.supervise.phase_switch import PhaseSwitch
from launcher.supervise.pod_run import PodRun
from launcher.supervise.pod_view import PodView, ProgressLine, warn
from launcher.supervise.ray_reach import unreachable
from launcher.supervise.plan import LaunchPlan
from launcher.supervise.restart import WorkerRestarter
from launcher.supervise.rollback import StageRollback
from launcher.supervise.stage_switch import record_stage
from launcher.supervise.starter import WorkerStarter
from launcher.supervise.state import (
    ENDED_POD_STATES,
    FINISHED_GPU_STATES,
    GpuState,
    PodEvent,
    PodState,
)
from launcher.worker.process import MetricsTail
from launcher.supervise.local_backend import LocalBackend


class Supervisor:
    """`backend` runs the workers (default: the plan's, made by open_backend after any --detach
    fork: RayBackend with `plan.ray`, else LocalBackend, child processes of this launcher);
    `custodian` keeps their checkpoints (default: the backend's); `clock` is the monotonic
    clock of hang and backoff timing (a fake one in tests). `faults`: gpu -> the fault of
    its first start; `launcher_id`: the pod lock's; `relaunched`: the last launcher's final
    saves each GPU resumes from (a rollback's target: never a copy)."""

    def __init__(self, plan: LaunchPlan, manifest: Manifest, index: CheckpointIndex,
                 events: EventLog, backend: WorkerBackend | None = None,
                 clock=time.monotonic, custodian: CheckpointCustodian | None = None,
                 faults: dict[int, str] | None = None, launcher_id: str | None = None,
                 relaunched: dict | None = None):
        # A Ray driver does not survive a fork: its backend is made by open_backend.
        self.connect_ray = backend is None and plan.ray is not None
        if backend is None:
            backend = LocalBackend(plan.pod_dir, plan.config)
        if custodian is None:
            custodian = LocalCustodian(plan.pod_dir, plan.config, events)
        self.pod = pod = PodRun(plan, manifest, index, events, backend, custodian, clock,
                                runs=_gpu_runs(plan, backend), probes=_probes(plan),
                                stage=plan.stage, launcher_id=launcher_id)
        pod.launch_entries.update(relaunched or {})   # a rollback's target: never a copy
        # ValueError for a malformed hub URL: the CLI reports it before anything starts.
        # The sync pushes under the custodian's lease: a refusal met by either stops both.
        self.sync = (HubSync(pod.pod_dir, plan.config, manifest, index, events,
                             lease=custodian.lease)
                     if plan.config.hub else None)
        if self.sync is not None:
            pod.on_manifest_change = self.sync.manifest_changed
        tracking = plan.config.tracker_settings()
        if tracking is not None:
            pod.tracker = TrackerSink(pod.pod_dir, tracking)
            events.taps.append(pod.tracker)
        self.view = PodView(pod)
        self.monitor = WorkerMonitor(pod)
        self.ending = PodEnding(pod, self.monitor, self.view)
        self.final = FinalVerdicts(pod, self.monitor, self.view)
        self.starter = WorkerStarter(pod, self.ending, self.view, faults)
        self.restarts = WorkerRestarter(pod)
        self.placement = NodePlacement(pod, self.starter)
        self.exits = ExitHandlers(pod, self.monitor, self.restarts, self.placement, self.ending,
                                  PhaseSwitch(pod, self.starter))
        self.rollback = StageRollback(pod, self.ending, self.starter, self.view)
        checkpoints = pod.pod_dir / plan.config.checkpoint_path(plan.slots[0].gpu)
        self.disk = DiskWatch([pod.pod_dir, checkpoints.parent], plan.config.disk_low_gib,
                              events, clock)
        # What a turn of the loop does for a GPU whose worker did not just end, by its state.
        self.tend_by_state = {GpuState.RUNNING: self.exits.on_silence,
                     GpuState.BACKOFF: self._restart_when_due,
                     GpuState.WAITING: self._place_when_running}
        self.stop_reason: str | None = None      # set by a signal: the loop stops the pod
        self.finishing = self.cut_short = False  # a second signal while ending cuts it short
        self.progress: ProgressLine | None = None   # the foreground launch's progress line
        self.started_at: float | None = None     # the launcher process's start (the ledger's
        self.gate_s = 0.0                        # start-up checks: to `launch`, less the gate)
        self.final_probes_s = 0.0

    def use_backend(self, backend: WorkerBackend, custodian: CheckpointCustodian) -> None:
        """Run the workers on `backend` and keep their checkpoints with `custodian` instead
        (chosen after a --detach fork, before anything is pushed). Checkpoints kept on the
        nodes are pushed by their nodes: the launcher's hub sync pushes the manifest that
        names them."""
        pod = self.pod
        pod.backend, pod.custodian = backend, custodian
        pod.runs = {g: GpuRun(r.slot, MetricsTail(backend.metrics_file(g)))
                    for g, r in pod.runs.items()}
        if self.sync is not None:
            self.sync.lease = custodian.lease
        if not custodian.on_nodes:
            return
        if self.sync is not None:
            self.sync.nodes_push(lambda: {g: c for g in pod.runs
                                          if (c := custodian.hub_copy(g)) is not None})
        nodes = custodian.node_probes()
        if pod.probes is not None and nodes is not None:   # where the checkpoints are
            pod.probes.use_nodes(nodes)
        elif pod.probes is not None:
            pod.probes = None
            pod.events.emit("probes_off", reason=f"the {backend.name} backend cannot "
                            f"probe the checkpoints on its nodes")

    def open_backend(self) -> None:
        """The plan's Ray backend and its checkpoints on the nodes, made once, after any
        --detach fork (a Ray driver does not survive one); UserError when Ray is missing or
        the cluster cannot be reached."""
        if self.connect_ray:
            self.connect_ray = False
            self.use_backend(*_ray_backend(self.pod.plan, self.pod.events))

    def gate(self, check) -> None:
        """Run `check` (the stage canary) in the CANARY state: it passes, or its refusal is
        raised on with the pod STOPPED (nothing switched, nothing started)."""
        self.pod.move(PodEvent.CANARY_STARTED)
        self.view.write(force=True)
        gate_started = time.time()
        # A rollback asked while the canary runs is refused when it ends: the canary decides
        # the switch, and nothing has switched or started to roll back.
        refusal = ("asked while the stage canary ran: nothing had switched; once the pod "
                   "runs, ask again (or `fractus-pod stop` it during a canary)")
        try:
            check()
        except BaseException as exc:
            self.gate_s = time.time() - gate_started
            self.pod.reason = str(getattr(exc, "message", exc))
            self.pod.move(PodEvent.CANARY_REFUSED)
            self.view.write(force=True)
            self.rollback.refuse_request(refusal)
            raise
        self.gate_s = time.time() - gate_started
        self.pod.move(PodEvent.CANARY_PASSED)
        self.rollback.refuse_request(refusal)

    # ---- run -> monitor -> restart, until the pod ends -----------------------------------
    def run(self, started_at: float | None = None, stop_reason: str | None = None,
            progress: ProgressLine | None = None) -> int:
        """`started_at`: the launcher process's start (the ledger's start-up checks);
        `stop_reason`: a stop that came before supervision; `progress`: the foreground's line."""
        pod = self.pod
        self.open_backend()
        self.started_at, self.progress = started_at, progress
        self.stop_reason = stop_reason or self.stop_reason
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # startup_s: the launcher's checks before this (its canary apart): paid GPU time.
        startup_s = (round(max(0.0, time.time() - self.started_at - self.gate_s), 3)
                     if self.started_at is not None else None)
        pod.events.emit("launch", stage=pod.stage, gpus=list(pod.runs),
                        devices=sorted({r.slot.device for r in pod.runs.values()}),
                        startup_s=startup_s)
        self.ending.reserve = DiskReserve(pod.pod_dir)
        pod.logs_id = dir_id(pod.pod_dir / "logs")
        try:
            if record_stage(pod.manifest, list(pod.runs), pod.stage, pod.events):
                pod.on_manifest_change("stage switch")
            self.starter.start_all()
        except OSError as exc:
            self.ending.on_write_error(exc)
        while pod.state not in ENDED_POD_STATES:
            try:
                self.step(pod.plan.deadline)
                if pod.state not in ENDED_POD_STATES:
                    time.sleep(pod.plan.config.poll_interval_s)
            except OSError as exc:
                self.ending.on_write_error(exc)
        self.view.write(force=True)
        if self.progress is not None:
            self.progress.show(force=True)      # where the run ended
        self.finishing = True
        self._end()
        if not pod.files_lost:     # the ledger's final probes and push: to the exit
            try:
                pod.events.emit("launch_end", final_probes_s=round(self.final_probes_s, 3))
            except OSError as exc:
                warn(f"the end of the launch could not be recorded: {exc}")
        self.ending.reserve.release()
        return pod.exit_code

    def step(self, deadline: float | None = None) -> None:
        """One turn of the loop: every worker, then the pod, then stop if asked or out of time."""
        logs_id = self.pod.logs_id
        if logs_id is not None and dir_id(self.pod.pod_dir / "logs") != logs_id:
            self.ending.files_lost(LOGS_MOVED, logs_id)
            return
        self._tend_workers()
        self._judge_pod()
        self.disk.check()
        if self.sync is not None:
            self.sync.tick()
        self.view.write()
        if self.progress is not None:
            self.progress.show()
        if not self.pod.running():
            return
        if self.stop_reason:
            self.ending.stop(self.stop_reason)
        elif deadline is not None and self.pod.clock() >= deadline:
            self.ending.stop(f"--max-time {self.pod.plan.max_time:g}s reached")

    def _tend_workers(self) -> None:
        pod = self.pod
        pod.backend.pump()
        pod.custodian.pump()
        self.monitor.note_pushed()
        now = pod.clock()
        for run in pod.runs.values():
            if run.proc is not None and run.proc.node:
                run.node = run.proc.node        # known once a remote backend placed it
            self.monitor.drain(run)
            ended = pod.backend.poll(run.proc) if run.proc is not None else None
            if ended is not None:
                self.monitor.drain(run)         # its last lines, before its exit is judged
                self.exits.on_exit(run, ended)
            elif run.state in self.tend_by_state:
                self.tend_by_state[run.state](run, now)
        self.monitor.collect_probes()
        self.monitor.judge_peers()

    def _restart_when_due(self, run: GpuRun, now: float) -> None:
        if self.restarts.due(run, now):
            self.starter.start(run, fresh_health=False)

    def _place_when_running(self, run: GpuRun, now: float) -> None:
        if self.pod.running():
            self.placement.place(run)

    def _judge_pod(self) -> None:
        pod = self.pod
        if not pod.running():
            return
        failed = [r for r in pod.runs.values() if r.health and r.health.failed()]
        if failed:
            self.rollback.roll_back(failed, auto=True)
            return
        self.rollback.take_request()
        self.rollback.announce_verdict()
        if all(r.state in FINISHED_GPU_STATES for r in pod.runs.values()) \
                and not (pod.probes is not None and pod.probes.busy()):
            pod.move(PodEvent.ALL_DONE)
            pod.events.emit("pod_done", stage=pod.stage)

    def _end(self) -> None:
        """After the loop: a clean end judges each GPU's last checkpoint, then the probes
        close, the custodian (its nodes' last pushes), the backend, and the hub sync (the
        end of a run is pushed, whatever ended it)."""
        pod = self.pod
        if pod.tracker is not None:      # the run's last lines, whatever ended it
            pod.tracker.close()
        if pod.files_lost:               # nothing can be read or recorded: only close
            if pod.probes is not None:
                pod.probes.close()
            pod.custodian.close(abandoned=lambda: True)
            pod.backend.close()
            return
        try:
            judging = time.time()
            if pod.state in (PodState.STOPPED, PodState.DONE):
                self.final.judge(cut_short=lambda: self.cut_short)
            if pod.probes is not None:
                pod.probes.close()
            self.final_probes_s = time.time() - judging
            pod.custodian.close(abandoned=lambda: self.cut_short)   # the nodes' last pushes
            pod.backend.close()
            self.monitor.note_pushed()
            if self.sync is not None:     # after them: the last push's manifest names them
                self.sync.finish(abandoned=lambda: self.cut_short,
                                 signalled=self.stop_reason is not None)
        except OSError as exc:
            if disk_full(exc) is None:
                raise
            warn(f"the end of the run could not be recorded: {exc}")

    def _on_signal(self, signum, frame) -> None:
        if self.finishing:           # a signal while the run ends: cut the ending short
            self.cut_short = True
        self.stop_reason = f"{signal.Signals(signum).name} received"


def _gpu_runs(plan: LaunchPlan, backend: WorkerBackend) -> dict[int, GpuRun]:
    return {s.gpu: GpuRun(s, MetricsTail(backend.metrics_file(s.gpu))) for s in plan.slots}


def _probes(plan: LaunchPlan) -> ProbeMonitor | None:
    return ProbeMonitor.from_trusted_loss(plan.pod_dir, plan.trusted, model=plan.config.model)


def _ray_backend(plan: LaunchPlan, events: EventLog):
    """The Ray pod's workers (RayBackend) and its checkpoints on the nodes (RayCustodian)."""
    try:
        # imported when run: only a Ray pod needs them (RayBackend imports the `ray` extra)
        from launcher.supervise.ray_backend import RayBackend
        from launcher.supervise.ray_custodian import RayCustodian
        backend = RayBackend(plan.pod_dir, plan.config, plan.ray, events, len(plan.slots))
        return backend, RayCustodian(backend)
    except ImportError:
        raise UserError(f"--ray needs Ray: {install_hint('ray')}") from None
    except ConnectionError as exc:
        raise UserError(unreachable(plan.ray.address, exc)) from None
