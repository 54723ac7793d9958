"""logs/pod_state.json, the view of the running pod `status` reads: a snapshot taken from
the PodRun, written at most every few seconds (the loop polls far more often), at once on
every change of the pod's state."""

from __future__ import annotations

import sys
import time

from fractus.train.disk import disk_full
from launcher.pod.live_state import GpuSnapshot, PodSnapshot, write_pod_state
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.state import GpuState

JUDGING = "judging"      # what `status` shows while a clean end's final probes run


def snapshot(pod: PodRun) -> PodSnapshot:
    return PodSnapshot(
        # `judging` is no state of the pod (it stays stopped or done): `stop` waits on it.
        pod_state=JUDGING if pod.judging else str(pod.state), stage=pod.stage,
        stage_name=pod.plan.stages[pod.stage].name, reason=pod.reason,
        started_at=pod.started_at, rolled_back=pod.rolled_back,
        gpus={gpu: gpu_snapshot(run) for gpu, run in pod.runs.items()},
        checkpoints_on_nodes=pod.custodian.on_nodes)


def gpu_snapshot(run: GpuRun) -> GpuSnapshot:
    verdict = run.health.verdict() if run.health else None
    # A GPU waiting for a node has no worker and no node: not the ones it lost.
    waiting = run.state is GpuState.WAITING
    return GpuSnapshot(
        pid=run.proc.pid if run.proc is not None and not waiting else None,
        device=run.slot.device, node=None if waiting else run.node, state=str(run.state),
        exit_code=run.exit_code,
        restarts=len(run.restarts), verdict=verdict.phase if verdict else None,
        reason=verdict.reason if verdict else None,
        checks=verdict.checks if verdict else {}, last_error=run.last_error,
        peers=dict(run.peer_marks))


class PodView:
    def __init__(self, pod: PodRun):
        self.pod = pod
        self.written_at = 0.0
        self.write_failed = False        # warned once, until a write succeeds again

    def write(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.pod.files_lost:          # logs/ is gone: writing would only recreate it
            return
        if not force and now - self.written_at < max(2.0, self.pod.plan.config.poll_interval_s):
            return
        self.written_at = now
        try:
            write_pod_state(self.pod.pod_dir, snapshot(self.pod))
        except OSError as exc:      # a view for `status`: the next write tries again
            if disk_full(exc) is None:
                raise
            if not self.write_failed:
                warn(f"logs/pod_state.json not written: {exc}")
            self.write_failed = True
        else:
            self.write_failed = False


def warn(message: str) -> None:
    """A line on the launcher's stderr, which may itself be a log on the full disk."""
    try:
        print(f"fractus-pod: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass
