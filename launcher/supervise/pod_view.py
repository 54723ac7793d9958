"""Views of the PodRun: logs/pod_state.json for `status` (at most every few seconds, at once
on a change of the pod's state) and the foreground launch's progress line."""

from __future__ import annotations

import sys
import time

from fractus.train.disk import no_space_error
from launcher.errors import warn
from launcher.pod.live_state import GpuSnapshot, PodSnapshot, write_pod_state
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.state import GpuState

JUDGING = "judging"      # what `status` shows while a clean end's final probes run
PROGRESS_EVERY_S = 10.0  # the foreground launch's progress line: one per this, terminal or pipe


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
    """Keeps the whole PodRun: a view of all of it (state, stage, reason, runs, ...)."""

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
            if no_space_error(exc) is None:
                raise
            if not self.write_failed:
                warn(f"logs/pod_state.json not written: {exc}")
            self.write_failed = True
        else:
            self.write_failed = False


class ProgressLine:
    """One plain line per PROGRESS_EVERY_S (whole lines for a pipe, never a redrawn bar)."""

    def __init__(self, pod: PodRun, out=None, every: float = PROGRESS_EVERY_S):
        self.pod, self.out, self.every = pod, out, every
        self.shown_at: float | None = None

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and self.shown_at is not None and now - self.shown_at < self.every:
            return
        self.shown_at = now
        try:
            print(self.line(), file=self.out or sys.stdout, flush=True)
        except OSError:
            pass                 # a closed terminal never stops the pod

    def line(self) -> str:
        elapsed = int(time.time() - self.pod.started_at)
        gpus = " | ".join(_gpu_progress(gpu, run) for gpu, run in sorted(self.pod.runs.items()))
        return f"progress {elapsed // 60}:{elapsed % 60:02d} {gpus}"


def _gpu_progress(gpu: int, run: GpuRun) -> str:
    m = run.last_metrics or {}
    if not isinstance(m.get("next_token"), int):
        return f"gpu{gpu} {run.state}"
    numbers = [f"{m['next_token']:,} tok"]
    if isinstance(m.get("tok_s"), (int, float)):
        numbers.append(f"{m['tok_s']:,.0f} tok/s")
    if isinstance(m.get("ema_tf"), (int, float)):
        numbers.append(f"ema_tf {m['ema_tf']:.4f}")
    state = "" if run.state is GpuState.RUNNING else f" ({run.state})"
    return f"gpu{gpu} " + " ".join(numbers) + state
