"""The data phase switch (docs/LAUNCHER.md "Data phases"): a GPU whose worker ended its
phase's shard goes on at the next phase's token 0, weights, optimizer and carry continuous.
The manifest write is the commit point: a launcher killed before it resumes at the old
phase's end (the worker ends its shard again at once and is switched then); after it, at
the new phase's token 0 (prepare's identity check accepts exactly this switch)."""

from __future__ import annotations

from launcher.pod.manifest import write_manifest
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.pod_run import PodRun
from launcher.supervise.state import GpuEvent

END_OF_SHARD = "end_of_shard"      # the worker's `done` reason (docs/WORKER.md)


class PhaseSwitch:
    def __init__(self, pod: PodRun, starter):
        self.pod, self.starter = pod, starter

    def next_phase(self, run: GpuRun) -> int | None:
        """The phase `run`'s GPU switches to now, or None (no end of shard, no next phase,
        or its final checkpoint refused: the checks judge that)."""
        if run.done_reason != END_OF_SHARD or run.done_at is None:
            return None
        entry = self.pod.manifest.entries.get(run.slot.gpu)
        if entry is None or entry.position != run.done_at or not entry.checkpoint:
            return None
        phase = entry.at_phase + 1
        return phase if phase <= len(self.pod.plan.config.phases) else None

    def switch(self, run: GpuRun) -> bool:
        """Start `run`'s GPU on its next phase; False: none (the caller marks it done)."""
        phase = self.next_phase(run)
        if phase is None:
            return False
        pod, gpu = self.pod, run.slot.gpu
        entry = pod.manifest.entries[gpu]
        ended_at, shard = entry.start_token, pod.plan.config.shard_path(gpu, phase)
        entry.switch_phase(phase, shard)
        write_manifest(pod.manifest)                      # the commit point
        pod.events.emit("phase_switch", gpu=gpu, from_phase=phase - 1, to_phase=phase,
                        name=pod.plan.config.phase(phase).name, ended_at_token=ended_at,
                        shard=shard, start_token=0, checkpoint=entry.checkpoint,
                        checkpoint_sha256=entry.checkpoint_sha256)
        pod.custodian.manifest_changed("phase switch")            # the hub gets it at once
        if pod.probes is not None:      # the new phase's AR baseline: this checkpoint, new data
            pod.probes.start_phase(gpu, entry.checkpoint, shard)
        run.apply(GpuEvent.FINISHED)                      # done with the old phase ...
        run.health.new_phase(phase)                       # new data: the curve starts over
        self.starter.start(run, fresh_health=False)       # ... and on the new one at once
        return True
