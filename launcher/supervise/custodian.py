"""The checkpoint custodian: everything about a checkpoint once a worker wrote it.

The worker backend (launcher/supervise/backend.py) only runs processes. What becomes of a
checkpoint after its `checkpoint` event is the custodian's: which name a probe reads it
under (retained, pinned), what a passed verdict sets off (a push from its node), the bytes
recovered before a restart, what a lost GPU or a rollback resumes from (its hub copy, or
where it stood at launch), the pushes its nodes made, where probes run, and the run's hub
lease (`lease`: one per launcher; the hub sync reads the same one).

Two implementations behind this one interface, which the supervisor's components call:
`LocalCustodian` (the files are on this machine) and, for a Ray pod, `RayCustodian`
(launcher/supervise/ray_custodian.py: the files are on the nodes, which push and probe
them; `NodeCustodian` below holds what does not need Ray).
"""

from __future__ import annotations

from pathlib import Path

from launcher.config.podconfig import PodConfig
from launcher.hub.recover import recover_entry
from launcher.hub.sync import RunLease
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest, ManifestEntry, resolve_in_pod


class CheckpointCustodian:
    """The checkpoints of a pod whose files are on this machine (LocalCustodian); a
    subclass for other places overrides what differs."""
    # Whether the checkpoints are on the workers' nodes rather than on this machine (for
    # `status`: none is "missing" from the head then).
    on_nodes = False

    def __init__(self, pod_dir: Path, config: PodConfig, events: EventLog):
        self.pod_dir, self.config, self.events = pod_dir, config, events
        self.lease = RunLease(pod_dir, events)

    def probe_name(self, record: dict, event: dict, rel: str) -> str | None:
        """The name an AR probe reads checkpoint `record` under (None: it cannot be probed);
        `event` is its checkpoint event, `rel` its path relative to the pod."""
        return probe_name(record, self.pod_dir)

    def passed(self, gpu: int, record: dict) -> None:
        """A checkpoint of `gpu` passed its checks. Once another pod writes the run, a
        passed checkpoint sets nothing off any more."""
        if self.lease.taken_over is None:
            self.keep(gpu, record)

    def keep(self, gpu: int, record: dict) -> None:
        """What a passed checkpoint sets off (a node pushes it); on this machine the hub
        sync's next push takes it (launcher/hub/sync.py)."""

    def restore(self, gpu: int, manifest: Manifest, index: CheckpointIndex) -> bool:
        """Before a restart: make the entry of `gpu` name a file holding its recorded bytes
        (launcher/hub/recover.py). True when the entry changed (the caller writes the
        manifest); raises RecoveryError when the bytes are nowhere."""
        return recover_entry(self.pod_dir, gpu, manifest, index, self.events,
                             self.config.hub, self.config.checkpoint_path(gpu))

    def hub_copy(self, gpu: int) -> dict | None:
        """The newest passed checkpoint of `gpu` its node pushed to the hub, as a
        checkpoint-index record plus `hub_revision` (None: none)."""
        return None

    def restore_point(self, gpu: int, launch: ManifestEntry | None) -> dict | None:
        """What a failed GPU rolls back to when no checkpoint of it passed here: its hub
        copy (None: nothing). `launch`: its entry at launch."""
        return self.hub_copy(gpu)

    def resume_copy(self, gpu: int) -> dict | None:
        """What a GPU whose node was lost resumes from: its hub copy, unless a newer
        trustworthy one is on the hub (Ray: its recovery copy, RayCustodian)."""
        return self.hub_copy(gpu)

    def take_pushed(self) -> list[dict]:
        """Checkpoints the nodes pushed since the last call: hub_copy records plus "node"."""
        return []

    def node_probes(self):
        """Where AR probes run when the checkpoints are not on this machine (an object for
        ProbeMonitor.use_nodes); None: on this machine."""
        return None

    def pump(self, force: bool = False) -> None:
        """Once per poll, after the backend's: start and collect the nodes' pushes."""

    def close(self, abandoned=lambda: False) -> None:
        """The run ended, before the backend closes: the last pushes go up (a second
        signal, `abandoned()`, gives them up)."""


class LocalCustodian(CheckpointCustodian):
    """The checkpoints are on this machine: retained links in the pod, recovered from a
    rotated copy or the hub before a restart, pushed by the launcher's hub sync."""


class NodeCustodian(CheckpointCustodian):
    """The checkpoints are on the workers' nodes: each node retains, recovers, pushes and
    probes its own."""
    on_nodes = True

    def probe_name(self, record: dict, event: dict, rel: str) -> str | None:
        # The node names the checkpoint by its sha256 (and checks it); one its node could
        # not retain is not probed (as probe_name says on one machine).
        return rel if event.get("retained", True) else None

    def restore(self, gpu: int, manifest: Manifest, index: CheckpointIndex) -> bool:
        # The node does it as it starts the worker: the entry's recorded bytes from its own
        # copy, or the hub's, or the start fails (launcher/supervise/ray_node.py).
        return False

    def restore_point(self, gpu: int, launch: ManifestEntry | None) -> dict | None:
        # The passed file is on a node's disk: its hub copy serves, else the checkpoint the
        # GPU resumed from at launch when the hub holds it (launched with --from-hub onto a
        # cluster: the head never held that file).
        return self.hub_copy(gpu) or launch_point(launch)


def launch_point(entry: ManifestEntry | None) -> dict | None:
    """The checkpoint a GPU resumed from at launch (`entry`), as a rollback target, when a
    hub revision holds it (so a node can pull it); None otherwise."""
    if entry is None or not (entry.checkpoint and entry.hub_revision):
        return None
    return {"next_token": entry.start_token, "phase": entry.at_phase, "path": entry.checkpoint,
            "sha256": entry.checkpoint_sha256, "hub_revision": entry.hub_revision,
            "ema_tf": entry.ema_tf, "lb": entry.lb}


def probe_name(record: dict, pod_dir) -> str | None:
    """The name under which a running worker's checkpoint can be probed: its retained link
    (bytes pinned). None when it has none although it lies in the pod: its event was read
    after the worker had saved past SAVE_KEEP, so its own name now holds newer bytes and a
    probe there would judge another checkpoint under this one's sha256 (a later
    checkpoint's probe vouches instead). A file outside the pod is never linked: its own
    name is all there is."""
    if record.get("retained"):
        return record["retained"]
    try:
        resolve_in_pod(record["path"], pod_dir)
    except ValueError:
        return record["path"]
    return None
