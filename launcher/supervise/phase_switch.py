"""The data phase switch: a GPU whose worker reached the end of its phase's shard goes on to
the next phase's shard at token 0, its weights, optimizer state and carry continuous.

The worker ends with `done` reason `end_of_shard` after its final checkpoint (which the
monitor has already put in the manifest). The switch records the new phase in the GPU's
manifest entry (phase, shard, start_token 0; the checkpoint it names, the end of the phase
before, stays): that write is the commit point. A launcher killed before it resumes the
GPU at the end of the old phase, whose worker ends its shard again at once and is switched
then; after it, the launch resumes at the new phase's token 0 (prepare's identity check
accepts exactly this switch). Then the `phase_switch` event and the hub sync told (it
pushes the changed manifest at its next tick) and the AR probes (the checkpoint probed on the
new shard is the new phase's baseline), then the worker's restart on
the new shard (PHASE=N: the worker starts at token 0 from the phase N-1 checkpoint). A GPU
whose last phase ends is done.
"""

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
        """The phase `run`'s GPU switches to now, or None: its worker did not end its shard,
        its last phase ended, or the manifest does not hold the end of the phase its worker
        trained (that final checkpoint was refused: the checks judge the GPU, not this)."""
        if run.done_reason != END_OF_SHARD or run.done_at is None:
            return None
        entry = self.pod.manifest.entries.get(run.slot.gpu)
        if entry is None or entry.position != run.done_at or not entry.checkpoint:
            return None
        phase = entry.at_phase + 1
        return phase if phase <= len(self.pod.plan.config.phases) else None

    def switch(self, run: GpuRun) -> bool:
        """Move `run`'s GPU to its next phase and start its worker there. False when it has
        none (the caller marks the GPU done)."""
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
