"""Starting workers from their manifest entries: every GPU's at a stage's start (with its
baseline probes), or one GPU's again. Owns the per-start state: each GPU's first fault."""

from __future__ import annotations

from typing import Callable

from launcher.checks.health import GpuHealth
from launcher.hub.recover import RecoveryError
from launcher.pod.manifest import RUN_ID_KEY, ManifestEntry, write_manifest
from launcher.supervise.ending import PodEnding
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.pod_view import PodView
from launcher.supervise.state import GpuEvent, PodEvent
from launcher.worker.process import WorkerSpec


class WorkerStarter:
    """Keeps the whole PodRun: it moves the pod's state (STARTED) and reads most of it."""

    def __init__(self, pod: PodRun, ending: PodEnding, view: PodView,
                 faults: dict[int, str] | None = None,
                 merge_env: Callable[[int, int | None], dict] | None = None):
        """`merge_env(gpu, start_token)`: its MERGE_* settings when the pod has merge rounds."""
        self.pod, self.ending, self.view = pod, ending, view
        self.faults = dict(faults or {})    # gpu -> FRACTUS_FAULT, for its first start only
        self.merge_env = merge_env

    def start_all(self) -> None:
        pod = self.pod
        for run in pod.runs.values():
            self.start(run, fresh_health=True)
        if pod.probes is not None:
            entries = {g: pod.manifest.entries.get(g) or ManifestEntry() for g in pod.runs}
            pod.probes.start_stage(pod.stage, {
                g: (e.checkpoint, e.shard or pod.plan.config.shard_path(g, e.at_phase))
                for g, e in entries.items()},
                heads={g: e.start_token for g, e in entries.items() if e.checkpoint})
        pod.move(PodEvent.STARTED)
        self.view.write(force=True)

    def start(self, run: GpuRun, fresh_health: bool) -> None:
        """Start `run`'s worker; `fresh_health`: new checks, else keep their history."""
        pod, gpu = self.pod, run.slot.gpu
        stage = pod.plan.stages[pod.stage]
        if not fresh_health and not self.recover(gpu):
            return
        entry = pod.manifest.entries.get(gpu)
        # At a phase's start the checkpoint's curve is of the phase before: nothing to continue.
        same_data = entry is not None and not entry.at_phase_start
        resume_ema = entry.ema_tf if same_data else None
        if fresh_health or run.health is None:
            run.checked_by(GpuHealth(pod.plan.criteria, stage.window,
                                     lb_baseline=entry.lb if same_data else None,
                                     resume_ema_tf=resume_ema))
        else:
            run.health.start(resume_ema)
        spec = self.spec(run)
        run.tail.read()                      # skip anything older than this start
        run.started(pod.backend.start(spec), pod.clock())
        pod.events.emit("worker_start", gpu=gpu, pid=run.proc.pid, stage=pod.stage,
                        start_token=spec.start_token, phase=spec.phase, checkpoint=spec.ckpt_in,
                        fault=spec.fault, **({"node": run.node} if run.node else {}))

    def spec(self, run: GpuRun) -> WorkerSpec:
        pod = self.pod
        entry = pod.manifest.entries.get(run.slot.gpu)
        return WorkerSpec(run.slot, pod.plan.stages[pod.stage].settings,
                          start_token=entry.start_token if entry else None,
                          ckpt_in=entry.checkpoint if entry else None,
                          max_steps=pod.plan.max_steps,
                          fault=self.faults.pop(run.slot.gpu, None), stage=pod.stage,
                          run_id=pod.manifest.extra.get(RUN_ID_KEY),
                          ckpt_sha256=entry.checkpoint_sha256 if entry else None,
                          ckpt_revision=entry.hub_revision if entry else None,
                          phase=entry.at_phase if entry else 1,
                          start_over=pod.custodian.starts_over(run.slot.gpu),
                          merge=self.merge_env(run.slot.gpu, entry.start_token if entry
                                               else None) if self.merge_env else None)

    def recover(self, gpu: int) -> bool:
        """Before a restart: the entry's checkpoint holds its recorded bytes (a worker killed
        between its rename and its event leaves a newer file). False: nowhere, pod failed."""
        pod = self.pod
        try:
            if pod.custodian.restore(gpu):
                write_manifest(pod.manifest)
        except RecoveryError as exc:
            pod.runs[gpu].apply(GpuEvent.GAVE_UP)
            self.ending.fail(f"GPU {gpu}: {exc}", exit_code=1)
            return False
        return True
