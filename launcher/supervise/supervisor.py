"""The pod supervisor: a single-threaded poll loop over one worker per GPU; `launch` builds it
and calls `run`. Decisions go to logs/events.jsonl before they act. Each turn: monitor,
react, restart, judge the pod, the custodian's turn, logs/pod_state.json. Components and
interfaces: docs/LAUNCHER.md "How the supervisor decides"."""

from __future__ import annotations

import signal
import time

from fractus.train.disk import no_space_error
from launcher.checks.probe_monitor import ProbeMonitor
from launcher.errors import UserError, install_hint, warn
from launcher.files import dir_id
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest
from launcher.supervise.backend import WorkerBackend
from launcher.supervise.custodian import CheckpointCustodian, LocalCopies
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
from launcher.supervise.pod_view import PodView, ProgressLine
from launcher.supervise.ray.reach import unreachable
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
from launcher.supervise.merge_rounds import MergeRounds
from fractus.train.env import WorkerSettings


class Supervisor:
    """`backend`: default the plan's (Ray, made by open_backend after any --detach fork, else
    LocalBackend); `copies`: default the backend's; `clock`: monotonic, of hangs and backoff.
    `faults`: gpu -> its first start's fault; `launcher_id`: the pod lock's; `custodian`:
    the launch's, made where it opened its records (it supervises from here on)."""

    def __init__(self, plan: LaunchPlan, manifest: Manifest, custodian: CheckpointCustodian,
                 events: EventLog, backend: WorkerBackend | None = None,
                 clock=time.monotonic, copies: LocalCopies | None = None,
                 faults: dict[int, str] | None = None, launcher_id: str | None = None):
        # A Ray driver does not survive a fork: its backend is made by open_backend.
        self.connect_ray = backend is None and plan.ray is not None
        if backend is None:
            backend = LocalBackend(plan.pod_dir, plan.config)
        custodian.supervise(copies)
        tracking = plan.config.tracker_settings()
        tracker = TrackerSink(plan.pod_dir, tracking) if tracking is not None else None
        if tracker is not None:
            events.taps.append(tracker)
        self.pod = pod = PodRun(plan, manifest, events, backend, custodian, clock,
                                runs=_gpu_runs(plan, backend), probes=_probes(plan),
                                stage=plan.stage, tracker=tracker, launcher_id=launcher_id)
        self.view = PodView(pod)
        self.monitor = WorkerMonitor(plan.config, plan.criteria, plan.pod_dir, clock, events,
                                     manifest, custodian, tracker, lambda: pod.runs,
                                     lambda: pod.stage, lambda: pod.probes)
        self.ending = PodEnding(pod, self.monitor, self.view)
        self.final = FinalVerdicts(plan.config, plan.pod_dir, events, custodian,
                                   lambda: pod.runs, lambda: pod.probes, lambda: pod.stage,
                                   pod.judging_final, self.monitor, self.view)
        self.rounds = _merge_rounds(plan, pod, events, custodian, clock)
        if self.rounds is not None:
            self.monitor.listen("merge_wait", self.rounds.on_wait)
            self.monitor.listen("merge_adopted", self.rounds.on_resumed)
            self.monitor.listen("merge_skipped", self.rounds.on_resumed)
        self.starter = WorkerStarter(pod, self.ending, self.view, faults,
                                     self.rounds.worker_env if self.rounds else None)
        self.restarts = WorkerRestarter(plan.criteria, clock, events, pod.running)
        self.placement = NodePlacement(manifest, events, custodian, lambda: pod.stage,
                                       lambda: pod.probes, lambda: pod.backend, self.starter)
        self.exits = ExitHandlers(events, lambda: pod.stage, pod.running, lambda: pod.backend,
                                  self.monitor, self.restarts, self.placement, self.ending,
                                  PhaseSwitch(plan.config, manifest, events, custodian,
                                              lambda: pod.probes, self.starter))
        self.rollback = StageRollback(pod, self.ending, self.starter, self.view)
        checkpoints = pod.pod_dir / plan.config.checkpoint_path(plan.slots[0].gpu)
        self.disk = DiskWatch([pod.pod_dir, checkpoints.parent], plan.config.disk_low_gib,
                              events, clock)
        self.tend_by_state = {GpuState.RUNNING: self.exits.on_silence,
                     GpuState.BACKOFF: self._restart_when_due,
                     GpuState.WAITING: self._place_when_running}
        self.stop_reason: str | None = None      # set by a signal: the loop stops the pod
        self.finishing = self.cut_short = False  # a second signal while ending cuts it short
        self.progress: ProgressLine | None = None   # the foreground launch's progress line
        self.started_at: float | None = None     # the launcher process's start (the ledger's
        self.gate_s = 0.0                        # start-up checks: to `launch`, less the gate)
        self.final_probes_s = 0.0

    def use_backend(self, backend: WorkerBackend, copies: LocalCopies) -> None:
        """Run the workers on `backend`, their checkpoints where `copies` says."""
        pod = self.pod
        pod.use_backend(backend, _gpu_runs(pod.plan, backend))
        pod.custodian.use_copies(copies)
        if not copies.on_nodes or pod.probes is None:
            return
        nodes = pod.custodian.node_probes()
        if nodes is not None:       # where the checkpoints are
            pod.probes.use_nodes(nodes)
        else:
            pod.probes_off()
            pod.events.emit("probes_off", reason=f"the {backend.name} backend cannot "
                            f"probe the checkpoints on its nodes")

    def open_backend(self) -> None:
        """Make the plan's Ray backend and copies once, after any --detach fork (a Ray driver
        does not survive one); UserError: Ray missing or unreachable."""
        if self.connect_ray:
            self.connect_ray = False
            self.use_backend(*_ray_backend(self.pod.plan, self.pod.events))

    def gate(self, check) -> None:
        """Run `check` (the stage canary) in state CANARY; a refusal is raised, pod STOPPED."""
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
            self.pod.move(PodEvent.CANARY_REFUSED, reason=str(getattr(exc, "message", exc)))
            self.view.write(force=True)
            self.rollback.refuse_request(refusal)
            raise
        self.gate_s = time.time() - gate_started
        self.pod.move(PodEvent.CANARY_PASSED)
        self.rollback.refuse_request(refusal)

    # ---- run -> monitor -> restart, until the pod ends -----------------------------------
    def run(self, started_at: float | None = None, stop_reason: str | None = None,
            progress: ProgressLine | None = None) -> int:
        """`started_at`: the launcher process's start; `stop_reason`: a stop before this."""
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
        self.ending.begin()
        pod.logs_opened(dir_id(pod.pod_dir / "logs"))
        try:
            if record_stage(pod.manifest, list(pod.runs), pod.stage, pod.events):
                pod.custodian.manifest_changed("stage switch")
            if self.rounds is not None:
                self.rounds.begin({g: (e.start_token if (e := pod.manifest.entries.get(g))
                                       else None) or 0 for g in pod.runs})
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
        if self.rounds is not None and self.pod.running():
            self.rounds.tick()
        self._judge_pod()
        self.disk.check()
        self.pod.custodian.tick()
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
        now = pod.clock()
        for run in pod.runs.values():
            run.placed()
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
            if self.rounds is not None and self.rounds.stage_end_pending(self._ends()):
                return                  # the stage's round decides before the pod is done
            pod.move(PodEvent.ALL_DONE)
            pod.events.emit("pod_done", stage=pod.stage)

    def _ends(self) -> dict[int, tuple[str, str, int]]:
        """Each GPU that finished cleanly: its manifest entry's (checkpoint, sha256, token)."""
        ends = {}
        for gpu, run in self.pod.runs.items():
            entry = self.pod.manifest.entries.get(gpu)
            if run.state == GpuState.DONE and entry is not None and entry.checkpoint \
                    and entry.checkpoint_sha256:
                ends[gpu] = (entry.checkpoint, entry.checkpoint_sha256, entry.start_token)
        return ends

    def _end(self) -> None:
        """After the loop: a clean end's final verdicts, then close probes, custodian, backend;
        the hub sync's last push comes whatever ended the run."""
        pod = self.pod
        if self.rounds is not None:      # a round in flight has no verdict: run again later
            self.rounds.close()
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
            pod.custodian.finish(abandoned=lambda: self.cut_short,   # the hub sync's last push
                                 signalled=self.stop_reason is not None)
        except OSError as exc:
            if no_space_error(exc) is None:
                raise
            warn(f"the end of the run could not be recorded: {exc}")

    def _on_signal(self, signum, frame) -> None:
        if self.finishing:           # a signal while the run ends: cut the ending short
            self.cut_short = True
        self.stop_reason = f"{signal.Signals(signum).name} received"


def _gpu_runs(plan: LaunchPlan, backend: WorkerBackend) -> dict[int, GpuRun]:
    return {s.gpu: GpuRun(s, MetricsTail(backend.metrics_file(s.gpu))) for s in plan.slots}


def _merge_rounds(plan: LaunchPlan, pod: PodRun, events: EventLog,
                  custodian: CheckpointCustodian, clock) -> MergeRounds | None:
    """The pod's merge rounds (fractus-pod.yaml `merge_rounds:`), None when off."""
    settings = plan.config.merge_round_settings()
    if settings is None:
        return None
    stage = plan.stages[plan.stage]
    seq = WorkerSettings.from_env({**stage.settings, **plan.config.env}).seq

    def shard(gpu: int) -> str:
        entry = pod.manifest.entries.get(gpu)
        return (entry.shard if entry and entry.shard else
                plan.config.shard_path(gpu, entry.at_phase if entry else 1))

    def baseline(gpu: int):
        known = pod.probes.baselines.get(shard(gpu)) if pod.probes is not None else None
        return known[0] if known else None

    return MergeRounds(settings, plan.pod_dir, events, plan.trusted.merge_gate,
                       plan.trusted.probe_tolerance, clock, lambda: pod.runs,
                       lambda: pod.stage, baseline, custodian.manifest_changed, shard, seq)


def _probes(plan: LaunchPlan) -> ProbeMonitor | None:
    return ProbeMonitor.from_trusted_loss(plan.pod_dir, plan.trusted, model=plan.config.model)


def _ray_backend(plan: LaunchPlan, events: EventLog):
    """The Ray pod's workers (RayBackend) and its checkpoints on the nodes (RayCustodian)."""
    try:
        # imported when run: only a Ray pod needs them (RayBackend imports the `ray` extra)
        from launcher.supervise.ray.copies import open_ray
        return open_ray(plan, events)
    except ImportError:
        raise UserError(f"--ray needs Ray: {install_hint('ray')}") from None
    except ConnectionError as exc:
        raise UserError(unreachable(plan.ray.address, exc)) from None
