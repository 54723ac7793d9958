"""Stage verdicts and rollback (docs/LAUNCHER.md "Rollback"): a GPU failing its checks at
stage N loses only its unverified progress; the pod runs on at stage N-1. The decision is
recorded before anything stops (a killed launcher's successor completes it); a failed GPU
is killed, since a graceful save would only rotate a good file out. Never loops: stage 1,
or a second failure, fails the pod."""

from __future__ import annotations

from launcher.checks.health import INCONCLUSIVE, SUCCESSFUL
from launcher.pod.decided_rollback import clear_decision, record_decision
from launcher.pod.failed_resume import start_over
from launcher.pod.live_state import take_rollback_request
from launcher.pod.manifest import apply_rollback, write_manifest
from launcher.supervise.ending import PodEnding
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.pod_view import PodView
from launcher.supervise.starter import WorkerStarter
from launcher.supervise.state import PodEvent


class StageRollback:
    """Keeps the whole PodRun: it moves the pod's state, its stage and its rolled_back."""

    def __init__(self, pod: PodRun, ending: PodEnding, starter: WorkerStarter, view: PodView):
        self.pod, self.ending, self.starter, self.view = pod, ending, starter, view
        self.announced: str | None = None     # the stage verdict last emitted

    def announce_verdict(self) -> None:
        runs = self.pod.runs.values()
        phases = {r.health.phase() for r in runs}
        verdict = None
        if phases == {SUCCESSFUL}:
            verdict = "stage_passed"
        elif INCONCLUSIVE in phases and phases <= {SUCCESSFUL, INCONCLUSIVE}:
            verdict = "stage_inconclusive"
        if verdict and verdict != self.announced:
            self.announced = verdict
            reasons = {r.slot.gpu: r.health.verdict().reason for r in runs}
            self.pod.events.emit(verdict, stage=self.pod.stage, reasons=reasons)

    def roll_back(self, failed: list[GpuRun], auto: bool, to_stage: int | None = None) -> None:
        pod = self.pod
        from_stage = pod.stage
        target_stage = from_stage - 1 if to_stage is None else to_stage
        for run in failed:
            pod.events.emit("check_failed", gpu=run.slot.gpu, stage=from_stage,
                            reason=run.health.verdict().reason)
        if auto and (from_stage <= 1 or pod.rolled_back):
            why = ("stage 1 failed: there is no stage below it" if from_stage <= 1 else
                   f"stage {from_stage} failed after a rollback: not looping")
            self.ending.fail(f"{why} (GPU {failed[0].slot.gpu}: "
                             f"{failed[0].health.verdict().reason})", exit_code=1)
            return
        # Durable before anything stops: a launcher killed from here on leaves it for the
        # next launch to complete by the same rule (launcher/pod/decided_rollback.py).
        targets = {r.slot.gpu: pod.custodian.rollback_target(r.slot.gpu) for r in failed}
        why = "; ".join(f"GPU {r.slot.gpu}: {r.health.verdict().reason}"
                        for r in failed) or "rollback requested by hand"
        record_decision(pod.pod_dir, list(targets), from_stage, target_stage, why, auto)
        start_over = [g for g, t in targets.items() if t is None and pod.custodian.never_passed(g)]
        pod.events.emit("rollback_decided", gpus=list(targets), from_stage=from_stage,
                        to_stage=target_stage, reason=why, automatic=auto,
                        start_over=start_over,     # None in to_tokens: nothing left, it fails
                        to_tokens={str(g): t["next_token"] if t else
                                   (0 if g in start_over else None)
                                   for g, t in targets.items()})
        pod.move(PodEvent.ROLLBACK)
        self.view.write(force=True)
        self.ending.stop_workers(kill_gpus=set(targets))
        for run in failed:
            if not self.restore(run, from_stage, target_stage, auto, targets[run.slot.gpu]):
                clear_decision(pod.pod_dir)      # the pod failed: ending.fail settled it
                return
        write_manifest(pod.manifest)
        clear_decision(pod.pod_dir)
        pod.rolling_back(auto)
        pod.events.emit("stage_change", from_stage=from_stage, to_stage=target_stage,
                        reason="rollback")
        pod.custodian.manifest_changed("rollback")
        pod.at_stage(target_stage)
        self.announced = None
        self.starter.start_all()
        pod.events.emit("pod_running", stage=pod.stage, after="rollback")

    def restore(self, run: GpuRun, from_stage: int, target_stage: int, auto: bool,
                target: dict | None) -> bool:
        """Set a failed GPU's entry to `target`, or token 0 when nothing it wrote passed;
        False (the pod failed) when it had passed checkpoints and none is left."""
        pod, gpu = self.pod, run.slot.gpu
        pod.custodian.fail_pending(gpu, f"GPU failed at stage {from_stage} before this was "
                                        f"verified")
        if target is None and not pod.custodian.never_passed(gpu):
            self.ending.fail(f"GPU {gpu} failed and none of its passed checkpoints is left "
                             f"intact to restore (see logs/checkpoints.jsonl)", exit_code=1)
            return False
        if target is None:           # nothing it wrote ever passed: back to where it began
            from_token = pod.manifest.start_token(gpu)
            moved = start_over(pod.pod_dir, pod.manifest, gpu,
                               pod.plan.config.checkpoint_path(gpu), target_stage)
            pod.events.emit("rollback", gpu=gpu, from_stage=from_stage, to_stage=target_stage,
                            from_token=from_token, to_token=0, checkpoint=None,
                            set_aside=moved, automatic=auto,
                            reason=f"{run.health.verdict().reason}; nothing it wrote passed: "
                                   f"it starts over")
            return True
        pod.events.emit("rollback", gpu=gpu, from_stage=from_stage, to_stage=target_stage,
                        from_token=pod.manifest.start_token(gpu),
                        to_token=target["next_token"], checkpoint=target["path"],
                        reason=run.health.verdict().reason, automatic=auto)
        apply_rollback(pod.manifest, gpu, target, target_stage)
        if target.get("hub_revision"):
            pod.manifest.note_hub_revision(gpu, target["hub_revision"], target["sha256"])
        return True

    def take_request(self) -> None:
        """A `fractus-pod rollback --to-stage N` issued while this launcher runs."""
        pod = self.pod
        request = take_rollback_request(pod.pod_dir)
        if request is None or self._stale(request):
            return
        if int(request["to_stage"]) > pod.stage:     # only down: up goes through the canary
            pod.events.emit("rollback_refused", to_stage=request["to_stage"], stage=pod.stage,
                            reason="rollback only goes down")
            return
        gpus = [g for g in request.get("gpus", []) if g in pod.runs]
        for gpu in gpus:
            pod.runs[gpu].health.fail("manual", "rollback requested by hand")
        self.roll_back([pod.runs[g] for g in gpus], auto=False,
                       to_stage=int(request["to_stage"]))


    def _stale(self, request: dict) -> bool:
        """A request made to another launcher (ended before taking it): dropped, and said."""
        if request.get("launcher_id") == self.pod.launcher_id:
            return False
        self.pod.events.emit("rollback_request_stale", to_stage=request.get("to_stage"),
                             gpus=request.get("gpus"), asked_at=request.get("ts"),
                             reason="asked of another launcher, which ended before taking "
                                    "it; ask again if it still holds")
        return True

    def refuse_request(self, reason: str) -> None:
        """Refuse a request that came while the canary ran, rather than fire it later."""
        request = take_rollback_request(self.pod.pod_dir)
        if request is not None and not self._stale(request):
            self.pod.events.emit("rollback_refused", to_stage=request.get("to_stage"),
                                 gpus=request.get("gpus"), stage=self.pod.stage,
                                 reason=reason)

