"""The pod supervisor: one worker per GPU, health checks, restarts, hang detection, rollback.

A single-threaded poll loop (every `poll_interval_s`): read each worker's new metrics
lines, feed the health checks, record checkpoints, react to exits and hangs, then write
logs/pod_state.json for `status`. Decisions go to logs/events.jsonl before they act.

Rollback (issue 4): when a GPU fails its checks at stage N, its worker is killed (its
progress since the last passed checkpoint is discarded; a graceful save would only
rotate a good file out), the others stop gracefully and keep their progress, the failed
GPU's manifest entry goes back to its newest passed checkpoint, and the pod restarts at
stage N-1. A failure at stage 1, or a second failure after a rollback, stops the pod:
FAILED, exit 1. It never loops.

Hub sync (issue 5, launcher/hub/sync.py): with a `hub:` configured, every poll gives the sync
policy a tick (it pushes in a background thread, never blocking this loop), and when the
loop ends the last push is made before the launcher exits, after a clean end's judgement
of each GPU's last checkpoint (launcher/supervise/ending.py, with the stop and failure paths).

AR probe (issue 6, launcher/checks/probe_monitor.py): with `probe.every` > 0 in the criteria, new
checkpoints are probed in background processes; each poll collects finished probes, and a
Failed one fails its GPU's stage like any other check. The pod is not done while a probe runs.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from fractus.train.disk import disk_full
from launcher.pod.ckpt_index import FAILED as CK_FAILED
from launcher.pod.ckpt_index import PASSED as CK_PASSED
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.supervise.ending import PodEnding, warn
from launcher.pod.events import EventLog
from launcher.supervise.gpu_run import GpuRun
from launcher.checks.health import INCONCLUSIVE, SUCCESSFUL, GpuHealth
from launcher.pod.manifest import (
    RUN_ID_KEY,
    BackwardsError,
    Manifest,
    apply_checkpoint,
    apply_rollback,
    relative_to_pod,
    write_manifest,
)
from launcher.supervise.prepare import LaunchPlan
from launcher.checks.probe_monitor import ProbeMonitor, apply_outcome
from launcher.hub.recover import RecoveryError, recover_entry
from launcher.pod.reserve import DiskReserve
from launcher.supervise.stage_switch import record_stage
from launcher.pod.live_state import write_pod_state
from launcher.supervise.backend import WorkerBackend, WorkerExit
from launcher.supervise.state import (
    ENDED_POD_STATES,
    FINISHED_GPU_STATES,
    GpuEvent,
    GpuState,
    PodEvent,
    PodState,
    exit_event,
    transition,
)
from launcher.hub.sync import HubSync
from launcher.worker.process import MetricsTail, WorkerSpec


class Supervisor(PodEnding):
    """`backend` runs the workers (default: LocalBackend, child processes of this launcher);
    `clock` is the monotonic clock of hang and backoff timing (a fake one in tests)."""

    def __init__(self, plan: LaunchPlan, manifest: Manifest, index: CheckpointIndex,
                 events: EventLog, backend: WorkerBackend | None = None,
                 clock=time.monotonic):
        self.plan, self.manifest, self.index, self.events = plan, manifest, index, events
        self.pod_dir: Path = plan.pod_dir
        self.stage = plan.stage
        if backend is None:
            from launcher.supervise.local import LocalBackend
            backend = LocalBackend(self.pod_dir, plan.config)
        self.backend, self.clock = backend, clock
        # Where each GPU stood at launch: its resume point after a lost node when the hub
        # holds nothing newer of it.
        self.launch_entries = {g: dict(e) for g, e in manifest.entries.items()}
        self.runs = {s.gpu: GpuRun(s, MetricsTail(backend.metrics_file(s.gpu)))
                     for s in plan.slots}
        self.pod_state = PodState.STARTING
        self.exit_code = 0
        self.rolled_back = False
        self.stop_reason: str | None = None
        self.started_at = time.time()
        self.announced: str | None = None
        self.reason = ""
        self._state_written = 0.0
        self.finishing = self.cut_short = False
        self.state_write_failed = False
        self.reserve: DiskReserve | None = None     # made by run(): it writes a file
        # ValueError for a malformed hub URL: the CLI reports it before anything starts.
        self.sync = (HubSync(self.pod_dir, plan.config, manifest, index, events)
                     if plan.config.hub else None)
        self.probes = (ProbeMonitor.from_trusted_loss(self.pod_dir, plan.trusted,
                                                      model=plan.config.model)
                       if plan.trusted is not None else
                       ProbeMonitor.from_criteria(self.pod_dir,
                                                  self.pod_dir / plan.config.criteria,
                                                  model=plan.config.model))

    def use_backend(self, backend: WorkerBackend) -> None:
        """Run the workers on `backend` instead (chosen after a --detach fork). A remote
        backend's nodes push their own checkpoints: the launcher's hub sync pushes the
        manifest that names them."""
        self.backend = backend
        self.runs = {g: GpuRun(r.slot, MetricsTail(backend.metrics_file(g)))
                     for g, r in self.runs.items()}
        if backend.name != "local":
            if self.sync is not None:
                self.sync.nodes_push(lambda: {g: c for g in self.runs
                                              if (c := backend.hub_copy(g)) is not None})
            nodes = backend.node_probes()
            if self.probes is not None and nodes is not None:   # where the checkpoints are
                self.probes.use_nodes(nodes)
            elif self.probes is not None:
                self.probes = None
                self.events.emit("probes_off", reason=f"the {backend.name} backend cannot "
                                 f"probe the checkpoints on its nodes")

    # ---- states ---------------------------------------------------------------------
    def _pod(self, event: PodEvent) -> None:
        self.pod_state = transition(self.pod_state, event)

    def gate(self, check) -> None:
        """Run `check` (the stage canary) in the CANARY state: it passes, or its refusal is
        raised on with the pod STOPPED (nothing switched, nothing started)."""
        self._pod(PodEvent.CANARY_STARTED)
        self._write_state(force=True)
        try:
            check()
        except BaseException as exc:
            self.reason = str(getattr(exc, "message", exc))
            self._pod(PodEvent.CANARY_REFUSED)
            self._write_state(force=True)
            raise
        self._pod(PodEvent.CANARY_PASSED)

    # ---- lifecycle ----------------------------------------------------------------
    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        deadline = self.plan.deadline
        self.events.emit("launch", stage=self.stage, gpus=[s.gpu for s in self.plan.slots],
                         devices=sorted({s.device for s in self.plan.slots}))
        self.reserve = DiskReserve(self.pod_dir)
        try:
            record_stage(self.manifest, list(self.runs), self.stage, self.events)
            self._start_all()
        except OSError as exc:
            self._on_write_error(exc)
        while self.pod_state not in ENDED_POD_STATES:
            try:
                self.step(deadline)
                if self.pod_state not in ENDED_POD_STATES:
                    time.sleep(self.plan.config.poll_interval_s)
            except OSError as exc:
                self._on_write_error(exc)
        self._write_state(force=True)
        self.finishing = True        # from here a second signal cuts the ending short
        try:
            if self.pod_state in (PodState.STOPPED, PodState.DONE):
                self._judge_final()
            if self.probes is not None:
                self.probes.close()
            self.backend.close(abandoned=lambda: self.cut_short)   # the nodes' last pushes
            self._note_pushed()
            if self.sync is not None:     # the end of a run is pushed, whatever ended it
                self.sync.finish(abandoned=lambda: self.cut_short)
        except OSError as exc:
            if disk_full(exc) is None:
                raise
            warn(f"the end of the run could not be recorded: {exc}")
        self.reserve.release()
        return self.exit_code

    def step(self, deadline: float | None = None) -> None:
        """One turn of the loop: monitor every worker, then stop if asked or out of time."""
        self._poll()
        if self.stop_reason and self.pod_state == PodState.RUNNING:
            self._stop(self.stop_reason)
        elif deadline is not None and self.clock() >= deadline \
                and self.pod_state == PodState.RUNNING:
            self._stop(f"--max-time {self.plan.max_time:g}s reached")

    def _on_signal(self, signum, frame) -> None:
        if self.finishing:           # a signal while the run ends: cut the ending short
            self.cut_short = True
        self.stop_reason = f"{signal.Signals(signum).name} received"

    def _start_all(self) -> None:
        for run in self.runs.values():
            self._start_worker(run, fresh_health=True)
        if self.probes is not None:
            entries = {g: self.manifest.entries.get(g) or {} for g in self.runs}
            self.probes.start_stage(self.stage, {
                g: (e.get("checkpoint"), e.get("shard") or self.plan.config.shard_path(g))
                for g, e in entries.items()},
                heads={g: e["start_token"] for g, e in entries.items() if e.get("checkpoint")})
        self._pod(PodEvent.STARTED)
        self._write_state(force=True)

    def _start_worker(self, run: GpuRun, fresh_health: bool) -> None:
        gpu = run.slot.gpu
        stage = self.plan.stages[self.stage]
        if not fresh_health and self.backend.files_here and not self._recover(gpu):
            return
        entry = self.manifest.entries.get(gpu)
        resume_ema = entry.get("ema_tf") if entry else None
        if fresh_health or run.health is None:
            run.health = GpuHealth(self.plan.criteria, stage.window,
                                   lb_baseline=entry.get("lb") if entry else None,
                                   resume_ema_tf=resume_ema)
        else:
            run.health.start(resume_ema)
        spec = self._spec(run)
        run.tail.read()                      # skip anything older than this start
        run.proc = self.backend.start(spec)
        run.apply(GpuEvent.STARTED)
        run.exit_code, run.node = None, run.proc.node
        run.started_at, run.last_line_at = self.clock(), None
        self.events.emit("worker_start", gpu=gpu, pid=run.proc.pid, stage=self.stage,
                         start_token=spec.start_token, checkpoint=spec.ckpt_in,
                         fault=spec.fault, **({"node": run.node} if run.node else {}))

    def _spec(self, run: GpuRun) -> WorkerSpec:
        entry = self.manifest.entries.get(run.slot.gpu)
        return WorkerSpec(run.slot, self.plan.stages[self.stage].settings,
                          start_token=entry["start_token"] if entry else None,
                          ckpt_in=entry.get("checkpoint") if entry else None,
                          max_steps=self.plan.max_steps,
                          fault=self.plan.faults.pop(run.slot.gpu, None), stage=self.stage,
                          run_id=self.manifest.extra.get(RUN_ID_KEY),
                          ckpt_sha256=entry.get("checkpoint_sha256") if entry else None,
                          ckpt_revision=entry.get("hub_revision") if entry else None)

    def _recover(self, gpu: int) -> bool:
        """Before a restart: the entry's checkpoint must hold its recorded bytes (a worker
        killed between its rename and its event leaves a newer file there; a file can be
        damaged mid-run). False when they are nowhere: the pod is failed, clearly."""
        try:
            if recover_entry(self.pod_dir, gpu, self.manifest, self.index, self.events,
                             self.plan.config.hub, self.plan.config.checkpoint_path(gpu)):
                write_manifest(self.manifest)
        except RecoveryError as exc:
            self.runs[gpu].apply(GpuEvent.GAVE_UP)
            self._fail_pod(f"GPU {gpu}: {exc}", exit_code=1)
            return False
        return True

    # ---- the poll loop ------------------------------------------------------------
    def _poll(self) -> None:
        self.backend.pump()
        self._note_pushed()
        now = self.clock()
        for run in self.runs.values():
            if run.proc is not None and run.proc.node:
                run.node = run.proc.node        # known once a remote backend placed it
            self._drain(run)
            ended = self.backend.poll(run.proc) if run.proc is not None else None
            if ended is not None:
                self._drain(run)
                self._on_exit(run, ended)
            elif run.state == GpuState.RUNNING and run.proc is not None:
                self._check_hang(run, now)
            elif run.state == GpuState.BACKOFF and now >= run.restart_at \
                    and self.pod_state == PodState.RUNNING:
                self._start_worker(run, fresh_health=False)
            elif run.state == GpuState.WAITING and self.pod_state == PodState.RUNNING:
                self._place(run)
        self._collect_probes()
        failed = [r for r in self.runs.values() if r.health and r.health.failed()]
        if failed and self.pod_state == PodState.RUNNING:
            self._rollback(failed, auto=True)
        elif self.pod_state == PodState.RUNNING:
            self._check_request()
            self._announce_stage_verdict()
            if all(r.state in FINISHED_GPU_STATES for r in self.runs.values()) \
                    and not (self.probes is not None and self.probes.busy()):
                self._pod(PodEvent.ALL_DONE)
                self.events.emit("pod_done", stage=self.stage)
        if self.sync is not None:
            self.sync.tick()
        self._write_state()

    def _collect_probes(self) -> None:
        for outcome in self.probes.poll() if self.probes is not None else ():
            self.events.emit("probe", stage=self.stage, **outcome.event_fields())
            apply_outcome(outcome, self.runs[outcome.request.gpu].health, self.index)
            self._mark_verified(self.runs[outcome.request.gpu])

    def _drain(self, run: GpuRun) -> None:
        for record in run.tail.read():
            if record.get("type") == "metrics":
                run.last_line_at = self.clock()
                run.last_metrics = record
                run.health.feed(record)
                self._mark_verified(run)
            elif record.get("type") == "event":
                kind = record.get("event")
                if kind == "checkpoint":
                    self._on_checkpoint(run, record)
                elif kind in ("nan", "oom"):
                    run.health.event(record)
                elif kind == "error":
                    run.last_error = str(record.get("message"))[:300]

    def _on_checkpoint(self, run: GpuRun, event: dict) -> None:
        gpu = run.slot.gpu
        rel = relative_to_pod(event["path"], self.pod_dir)
        record = self.index.add(gpu, event, self.stage, rel)
        if run.health.failed():
            self.index.mark(gpu, record["sha256"], CK_FAILED, "written after its GPU failed")
            return
        if event.get("ema_tf") is None:   # stopped before its first step: nothing to resume
            self.index.mark(gpu, record["sha256"], CK_FAILED, "no training step behind it")
            return
        try:
            changed = apply_checkpoint(self.manifest, gpu, event, self.stage, self.pod_dir,
                                       self.plan.config.shard_path(gpu))
        except BackwardsError as exc:
            self.events.emit("manifest_refused", gpu=gpu, reason=str(exc))
            return
        if changed:
            write_manifest(self.manifest)
        if self.probes is not None:
            self.probes.on_checkpoint(gpu, record.get("retained") or rel,
                                      self.plan.config.shard_path(gpu), record["sha256"],
                                      record.get("step"))
        self._mark_verified(run)

    def _mark_verified(self, run: GpuRun) -> None:
        verified = run.health.verified_step
        if self.probes is not None and verified is not None:    # the AR probe vouches too
            vouched = self.probes.vouched_step(run.slot.gpu)
            verified = None if vouched is None else min(verified, vouched)
        if verified is None or (verified, self.index.size) == run.verified_seen:
            return          # nothing new to judge: the common case, once per metrics line
        run.verified_seen = (verified, self.index.size)
        for record in self.index.pending(run.slot.gpu):
            if record.get("step") is not None and record["step"] <= verified:
                passed = self.index.mark(run.slot.gpu, record["sha256"], CK_PASSED,
                                         f"checks passed through step {verified} at stage "
                                         f"{self.stage}")
                self.backend.on_passed(run.slot.gpu, passed)

    def _on_exit(self, run: GpuRun, ended: WorkerExit) -> None:
        gpu, code = run.slot.gpu, ended.code
        run.proc, run.exit_code = None, code
        if ended.node_lost:
            self._on_node_lost(run)
            return
        self.events.emit("worker_exit", gpu=gpu, code=code, stage=self.stage,
                         **({"error": ended.error} if ended.error else {}))
        event = exit_event(code, self.pod_state == PodState.RUNNING)
        if event is GpuEvent.CRASHED:
            self._crash(run, ended.error or f"exit code {code}")
            return
        run.apply(event)
        if event is GpuEvent.DISK_FULL:
            self._disk_full(f"GPU {gpu}'s worker could not write (exit {code}"
                            + (f": {run.last_error}" if run.last_error else "") + ")")
        elif event is GpuEvent.REFUSED:
            self._fail_pod(f"GPU {gpu}: the worker refused its settings or files (exit 2); "
                           f"see logs/worker_gpu{gpu}.log", exit_code=2)
        elif event is GpuEvent.CHECK_EXIT:
            run.health.exit_code(code)

    def _crash(self, run: GpuRun, reason: str) -> None:
        policy = self.plan.criteria.restarts
        now = self.clock()
        run.restarts.append(now)
        while run.restarts and run.restarts[0] < now - policy.window_s:
            run.restarts.popleft()
        if len(run.restarts) > policy.max_restarts:
            run.apply(GpuEvent.GAVE_UP)
            run.health.fail("restarts", f"{len(run.restarts)} crashes within "
                                        f"{policy.window_s:g}s (last: {reason})")
            return
        delay = policy.backoff(len(run.restarts))
        run.apply(GpuEvent.CRASHED)
        run.restart_at = now + delay
        self.events.emit("worker_crash", gpu=run.slot.gpu, reason=reason,
                         restart_in_s=delay, restarts=len(run.restarts))

    def _check_hang(self, run: GpuRun, now: float) -> None:
        hang = self.plan.criteria.hang
        since = run.last_line_at if run.last_line_at is not None else run.started_at
        limit = hang.timeout_s if run.last_line_at is not None else hang.startup_timeout_s
        if now - since <= limit:
            return
        self.events.emit("hang", gpu=run.slot.gpu, pid=run.proc.pid,
                         silent_s=round(now - since, 2), limit_s=limit)
        ended = self.backend.kill(run.proc)
        self._drain(run)
        run.proc, run.exit_code = None, ended.code
        if ended.node_lost:
            self._on_node_lost(run)
            return
        self._crash(run, f"hang: no metrics line for {now - since:.0f}s")

    def _note_pushed(self) -> None:
        """A node pushed a passed checkpoint: the manifest notes its hub revision where the
        entry still names those bytes (as launcher/hub/sync.py does for the launcher's pushes)."""
        noted = []
        for copy in self.backend.take_pushed():
            gpu = copy["gpu"]
            entry = self.manifest.entries.get(gpu)
            if entry and entry.get("checkpoint_sha256") == copy["sha256"]:
                entry["hub_revision"] = copy["hub_revision"]
                noted.append(gpu)
            self.events.emit("sync_pushed", reason="node", gpu=gpu, node=copy.get("node"),
                             revision=copy["hub_revision"],
                             tokens={gpu: int(copy["next_token"])}, files=1,
                             hub_revision_for=[gpu] if gpu in noted else [])
        if noted:
            write_manifest(self.manifest)

    # ---- node loss (a remote backend) -----------------------------------------------
    def _on_node_lost(self, run: GpuRun) -> None:
        """The machine under a GPU's worker is gone, with its disk: the GPU resumes from its
        newest passed checkpoint on the hub (else where it stood at launch), exactly at that
        checkpoint's tokens, once a node has a free device for it."""
        gpu = run.slot.gpu
        run.apply(GpuEvent.NODE_LOST)
        self.events.emit("node_lost", gpu=gpu, node=run.node, stage=self.stage)
        for request in self.probes.abandon(gpu) if self.probes is not None else ():
            self.events.emit("probe_abandoned", gpu=gpu, node=run.node, role=request.role,
                             sha256=request.sha256, reason="its node was lost")
        for record in self.index.pending(gpu):     # never judged; their disk is gone
            self.index.mark(gpu, record["sha256"], CK_FAILED, f"lost with node {run.node}")
        from_token = self.manifest.entries.get(gpu, {}).get("start_token")
        target = self.backend.hub_copy(gpu)
        if target is not None:
            apply_rollback(self.manifest, gpu, target, self.stage)
            self.manifest.entries[gpu]["hub_revision"] = target["hub_revision"]
        elif self.launch_entries.get(gpu):
            self.manifest.entries[gpu] = dict(self.launch_entries[gpu])
        else:
            self.manifest.entries.pop(gpu, None)    # nothing kept anywhere: a fresh start
        entry = self.manifest.entries.get(gpu) or {}
        if entry.get("checkpoint") and not entry.get("hub_revision"):
            run.apply(GpuEvent.GAVE_UP)
            run.health.fail("node_lost", f"node {run.node} was lost and the hub holds no "
                                         f"checkpoint of GPU {gpu} to resume from")
            return
        write_manifest(self.manifest)
        self.events.emit("resume_point", gpu=gpu, from_token=from_token,
                         to_token=entry.get("start_token", 0),
                         checkpoint=entry.get("checkpoint"),
                         hub_revision=entry.get("hub_revision"), reason="node lost")
        run.announced_wait = False
        self._place(run)

    def _place(self, run: GpuRun) -> None:
        """Start a WAITING GPU once a node has a free device; until then it waits, visibly."""
        if self.backend.can_place(run.slot):
            self._start_worker(run, fresh_health=False)
        elif not run.announced_wait:
            run.announced_wait = True
            self.events.emit("gpu_waiting", gpu=run.slot.gpu, stage=self.stage,
                             reason="no node has a free device; waiting for one to join")

    # ---- stage verdicts, rollback, stop -------------------------------------------
    def _announce_stage_verdict(self) -> None:
        phases = {r.health.phase() for r in self.runs.values()}
        verdict = None
        if phases == {SUCCESSFUL}:
            verdict = "stage_passed"
        elif INCONCLUSIVE in phases and phases <= {SUCCESSFUL, INCONCLUSIVE}:
            verdict = "stage_inconclusive"
        if verdict and verdict != self.announced:
            self.announced = verdict
            reasons = {r.slot.gpu: r.health.verdict().reason for r in self.runs.values()}
            self.events.emit(verdict, stage=self.stage, reasons=reasons)

    def _rollback(self, failed: list[GpuRun], auto: bool, to_stage: int | None = None) -> None:
        from_stage = self.stage
        target_stage = from_stage - 1 if to_stage is None else to_stage
        for run in failed:
            self.events.emit("check_failed", gpu=run.slot.gpu, stage=from_stage,
                             reason=run.health.verdict().reason)
        if auto and (from_stage <= 1 or self.rolled_back):
            why = ("stage 1 failed: there is no stage below it" if from_stage <= 1 else
                   f"stage {from_stage} failed after a rollback: not looping")
            self._fail_pod(f"{why} (GPU {failed[0].slot.gpu}: "
                           f"{failed[0].health.verdict().reason})", exit_code=1)
            return
        self._pod(PodEvent.ROLLBACK)
        self._write_state(force=True)
        self._stop_workers(kill_gpus={r.slot.gpu for r in failed})
        for run in failed:
            gpu = run.slot.gpu
            for record in self.index.pending(gpu):
                self.index.mark(gpu, record["sha256"], CK_FAILED,
                                f"GPU failed at stage {from_stage} before this was verified")
            # On a remote backend the passed file is on a node's disk: its hub copy serves.
            target = self.index.newest_passed(gpu) or self.backend.hub_copy(gpu)
            if target is None:
                self._fail_pod(f"GPU {gpu} failed and has no passed checkpoint to restore",
                               exit_code=1)
                return
            self.events.emit("rollback", gpu=gpu, from_stage=from_stage, to_stage=target_stage,
                             from_token=self.manifest.start_token(gpu),
                             to_token=target["next_token"], checkpoint=target["path"],
                             reason=run.health.verdict().reason, automatic=auto)
            apply_rollback(self.manifest, gpu, target, target_stage)
            if target.get("hub_revision"):
                self.manifest.entries[gpu]["hub_revision"] = target["hub_revision"]
        write_manifest(self.manifest)
        self.rolled_back = self.rolled_back or auto
        self.events.emit("stage_change", from_stage=from_stage, to_stage=target_stage,
                         reason="rollback")
        self.stage, self.announced = target_stage, None
        self._start_all()
        self.events.emit("pod_running", stage=self.stage, after="rollback")

    def _check_request(self) -> None:
        """A `fractus-pod rollback --to-stage N` issued while this launcher runs."""
        from launcher.pod.live_state import take_rollback_request
        request = take_rollback_request(self.pod_dir)
        if request is None:
            return
        if int(request["to_stage"]) > self.stage:     # only down: up goes through the canary
            self.events.emit("rollback_refused", to_stage=request["to_stage"], stage=self.stage,
                             reason="rollback only goes down")
            return
        gpus = [g for g in request.get("gpus", []) if g in self.runs]
        for gpu in gpus:
            self.runs[gpu].health.fail("manual", "rollback requested by hand")
        self._rollback([self.runs[g] for g in gpus], auto=False,
                       to_stage=int(request["to_stage"]))

    def _write_state(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._state_written < max(2.0, self.plan.config.poll_interval_s):
            return
        self._state_written = now
        try:
            write_pod_state(self)
        except OSError as exc:      # a view for `status`: the next write tries again
            if disk_full(exc) is None:
                raise
            if not self.state_write_failed:
                warn(f"logs/pod_state.json not written: {exc}")
            self.state_write_failed = True
        else:
            self.state_write_failed = False

