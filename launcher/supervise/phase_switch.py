"""The data phase switch (docs/LAUNCHER.md "Data phases"): a GPU whose worker ended its
phase's shard goes on at the next phase's token 0, weights, optimizer and carry continuous.
The manifest write is the commit point: a launcher killed before it resumes at the old
phase's end (the worker ends its shard again at once and is switched then); after it, at
the new phase's token 0 (prepare's identity check accepts exactly this switch)."""

from __future__ import annotations

from typing import Callable

from launcher.checks.probe_monitor import ProbeMonitor
from launcher.config.podconfig import PodConfig
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest, write_manifest
from launcher.supervise.custodian import CheckpointCustodian
from launcher.supervise.gpu_run import GpuRun
from launcher.supervise.state import GpuEvent

END_OF_SHARD = "end_of_shard"      # the worker's `done` reason (docs/WORKER.md)


class PhaseSwitch:
    def __init__(self, config: PodConfig, manifest: Manifest, events: EventLog,
                 custodian: CheckpointCustodian, probes: Callable[[], ProbeMonitor | None],
                 starter):
        """`probes`: the pod's probes now (None once they are off)."""
        self.config, self.manifest, self.events = config, manifest, events
        self.custodian, self.probes, self.starter = custodian, probes, starter

    def next_phase(self, run: GpuRun) -> int | None:
        """The phase `run`'s GPU switches to now, or None (no end of shard, no next phase,
        or its final checkpoint refused: the checks judge that)."""
        if run.done_reason != END_OF_SHARD or run.done_at is None:
            return None
        entry = self.manifest.entries.get(run.slot.gpu)
        if entry is None or entry.position != run.done_at or not entry.checkpoint:
            return None
        phase = entry.at_phase + 1
        return phase if phase <= len(self.config.phases) else None

    def switch(self, run: GpuRun) -> bool:
        """Start `run`'s GPU on its next phase; False: none (the caller marks it done)."""
        phase = self.next_phase(run)
        if phase is None:
            return False
        gpu, config = run.slot.gpu, self.config
        entry = self.manifest.entries[gpu]
        ended_at, shard = entry.start_token, config.shard_path(gpu, phase)
        entry.switch_phase(phase, shard)
        write_manifest(self.manifest)                     # the commit point
        self.events.emit("phase_switch", gpu=gpu, from_phase=phase - 1, to_phase=phase,
                        name=config.phase(phase).name, ended_at_token=ended_at,
                        shard=shard, start_token=0, checkpoint=entry.checkpoint,
                        checkpoint_sha256=entry.checkpoint_sha256)
        self.custodian.manifest_changed("phase switch")           # the hub gets it at once
        probes = self.probes()
        if probes is not None:          # the new phase's AR baseline: this checkpoint, new data
            probes.start_phase(gpu, entry.checkpoint, shard)
        run.apply(GpuEvent.FINISHED)                      # done with the old phase ...
        run.health.new_phase(phase)                       # new data: the curve starts over
        self.starter.start(run, fresh_health=False)       # ... and on the new one at once
        return True
