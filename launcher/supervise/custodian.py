"""The one owner of a checkpoint from its worker's `checkpoint` event to its last copy: only
the launch steps (before the supervisor) and the supervisor's components call it, nothing
else touches these facts. Private parts: the index (launcher/pod/ckpt_index.py, made here),
the hub sync (launcher/hub/sync.py), the run's one `RunLease` (made only here), and where the
copies are (`LocalCopies`, `NodeCopies`; Ray: `RayCustodian`), the only difference between
local and Ray pods. See docs/LAUNCHER.md
"How the supervisor decides"."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from launcher.config.podconfig import PodConfig
from launcher.files import sha256_file
from launcher.hub.recover import recover_all, recover_entry
from launcher.hub.sync import HubSync, RunLease, note_manifest_changed
from launcher.paths import metrics_path
from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.pod.decided_rollback import clear_decision, complete_decision
from launcher.pod.events import EventLog
from launcher.pod.failed_resume import restore_passed, starts_over
from launcher.pod.manifest import (Manifest, ManifestEntry, apply_checkpoint, event_phase,
                                   event_position, relative_to_pod, resolve_in_pod,
                                   write_manifest)
from launcher.worker.process import read_records

if TYPE_CHECKING:
    from launcher.supervise.plan import LaunchPlan


class CheckpointCustodian:
    """Made where the launch opens its records (`for_plan`), with its index: the launch steps
    call its preparation (`complete_decided_rollback`, `reconcile`, `never_resume_failed`,
    `recover`; on Ray, ray/copies.py's `resume_newer_copies` with it), then the Supervisor
    `supervise`s with it. `gpus`: the pod's GPUs."""

    def __init__(self, pod_dir: Path, config: PodConfig, gpus: list[int], manifest: Manifest,
                 events: EventLog):
        self.pod_dir, self.config, self.gpus = pod_dir, config, list(gpus)
        self.manifest, self.events = manifest, events
        self.index = CheckpointIndex(pod_dir)       # private: written only through this class
        # The entries a relaunch replaced by newer recovery copies (a rollback goes back to
        # those, never to a copy): set by relaunched_from.
        self.relaunched: dict[int, ManifestEntry] = {}
        self.launch_entries: dict[int, ManifestEntry] = {}
        self.lease = RunLease(pod_dir, events)      # every push, the sync's or a node's, asks it
        self.sync: HubSync | None = None
        self.copies: LocalCopies | None = None      # set by supervise

    @classmethod
    def for_plan(cls, plan: LaunchPlan, manifest: Manifest,
                 events: EventLog) -> CheckpointCustodian:
        return cls(plan.pod_dir, plan.config, [s.gpu for s in plan.slots], manifest, events)

    def supervise(self, copies: LocalCopies | None = None) -> None:
        """The supervisor takes over (its constructor, after the preparation): where each GPU
        stands at launch, the hub sync, and where the checkpoints are (`copies`; default this
        machine). ValueError for a malformed hub URL."""
        # Where each GPU stood at launch: its resume point after a lost node, or a
        # rollback's, when nothing newer passed.
        self.launch_entries = {g: e.copy() for g, e in self.manifest.entries.items()}
        self.launch_entries.update(self.relaunched)
        self.sync = (HubSync(self.pod_dir, self.config, self.manifest, self.index, self.events,
                             self.lease)
                     if self.config.hub else None)
        self.use_copies(copies or LocalCopies(self.pod_dir, self.config, self.events))

    # ---- before the supervisor: the launch's preparation ------------------------------------
    def relaunched_from(self, entries: dict[int, ManifestEntry]) -> None:
        """On Ray, `entries`: those the last launcher's newer final saves replaced
        (resume_newer_copies, launcher/supervise/ray/copies.py)."""
        self.relaunched = dict(entries)

    def failed(self, gpu: int, sha256: str) -> bool:
        """Whether that checkpoint of `gpu` was judged failed."""
        record = self.index.records.get((gpu, sha256))
        return record is not None and record["verdict"] == FAILED

    def complete_decided_rollback(self) -> int | None:
        """Complete a rollback the last launcher decided and died carrying out, before
        reconcile could adopt the failed GPU's unjudged checkpoints. The stage it went back
        to, or None when none was decided."""
        to_stage = complete_decision(self.pod_dir, self.manifest, self.index, self.events,
                                     self.config.checkpoint_path)
        if to_stage is None:
            return None
        write_manifest(self.manifest)
        clear_decision(self.pod_dir)
        if self.config.hub:      # the hub still holds the stage rolled back from
            note_manifest_changed(self.pod_dir, "rollback")
        return to_stage

    def reconcile(self, stage: int) -> None:
        """Adopt a checkpoint a worker wrote after its launcher died (verified by sha256),
        recorded at its entry's stage, else `stage`."""
        changed = False
        for gpu in self.gpus:
            entry = self.manifest.entries.get(gpu)
            since = (entry.updated_at or 0.0) if entry else 0.0
            current = entry.position if entry else (1, -1)
            candidates = [r for r in read_records(self.pod_dir / metrics_path(gpu))
                          if r.get("event") == "checkpoint" and r.get("ts", 0) > since
                          and isinstance(r.get("next_token"), int)
                          and event_position(r) > current]
            for event in sorted(candidates, key=event_position, reverse=True):
                recorded = self.index.records.get((gpu, event.get("sha256")))
                if recorded is not None and recorded["verdict"] == FAILED:
                    continue
                path = self.pod_dir / relative_to_pod(event["path"], self.pod_dir)
                if not path.is_file() or sha256_file(path) != event.get("sha256"):
                    continue
                at = (entry.stage if entry else None) or stage
                rel = relative_to_pod(event["path"], self.pod_dir)
                self.index.add(gpu, event, at, rel)
                apply_checkpoint(self.manifest, gpu, event, at, self.pod_dir,
                                 self.config.shard_path(gpu, event_phase(event)))
                self.events.emit("manifest_reconciled", gpu=gpu,
                                 start_token=int(event["next_token"]), checkpoint=rel,
                                 reason="checkpoint written after the launcher stopped")
                changed = True
                break
        if changed:
            write_manifest(self.manifest)

    def never_resume_failed(self) -> None:
        """Entries naming a failed checkpoint go to the newest passed one; none left refuses
        (UserError)."""
        if restore_passed(self.manifest, self.index, self.events, self.gpus, refuse=True,
                          own_file_of=self.config.checkpoint_path):
            write_manifest(self.manifest)

    def recover(self, on_hub: set[int] = frozenset()) -> None:
        """Each named checkpoint holds its entry's bytes (hashed in parallel), else recovered
        from a local copy or the hub, or refused. `on_hub`: GPUs whose nodes fetch their own."""
        if recover_all(self.pod_dir, [g for g in self.gpus if g not in on_hub], self.manifest,
                       self.index, self.events, self.config.hub, self.config.checkpoint_path):
            write_manifest(self.manifest)

    def use_copies(self, copies: LocalCopies) -> None:
        """Keep the checkpoints where `copies` says (chosen after a --detach fork, before any
        push). On nodes, the nodes push them and the hub sync the manifest naming them."""
        copies.attach(self.lease)
        self.copies = copies
        if copies.on_nodes and self.sync is not None:
            self.sync.nodes_push(lambda: {g: c for g in self.gpus
                                          if (c := copies.hub_copy(g)) is not None})

    @property
    def on_nodes(self) -> bool:
        return self.copies.on_nodes

    @property
    def taken_over(self) -> str | None:
        """Another pod writes the run (the refusal's one line): nothing is pushed any more."""
        return self.lease.taken_over

    # ---- a checkpoint's record and verdict --------------------------------------------------
    @property
    def changes(self) -> int:
        """A counter that moves with every record written (cheap change detection)."""
        return self.index.size

    def record(self, gpu: int, event: dict, stage: int, rel: str) -> dict:
        """Record a worker's checkpoint event (`rel`: relative to the pod), pending, retained."""
        return self.index.add(gpu, event, stage, rel)

    def pending(self, gpu: int) -> list[dict]:
        return self.index.pending(gpu)

    def record_of(self, gpu: int, sha256: str) -> dict:
        return self.index.records[(gpu, sha256)]

    def fail(self, gpu: int, sha256: str, reason: str) -> None:
        self.index.mark(gpu, sha256, FAILED, reason)

    def fail_pending(self, gpu: int, reason: str) -> None:
        """Every checkpoint of `gpu` not judged yet is failed (its GPU failed or was lost)."""
        for record in self.index.pending(gpu):
            self.index.mark(gpu, record["sha256"], FAILED, reason)

    def fail_from(self, gpu: int, sha256: str, reason: str) -> None:
        """Fail `sha256` of `gpu` and every newer one (an AR probe failed it): no rollback
        restores them."""
        rows = self.index.for_gpu(gpu)
        probed = next((r for r in rows if r["sha256"] == sha256), None)
        if probed is None:
            return
        for record in rows:
            if event_position(record) >= event_position(probed) and record["verdict"] != FAILED:
                self.index.mark(gpu, record["sha256"], FAILED, reason)

    def passed(self, gpu: int, sha256: str, reason: str) -> None:
        """Mark it passed; its copies push it unless another pod writes the run."""
        record = self.index.mark(gpu, sha256, PASSED, reason)
        if self.lease.taken_over is None:
            self.copies.keep(gpu, record)

    def never_passed(self, gpu: int) -> bool:
        return not any(r["verdict"] == PASSED for r in self.index.for_gpu(gpu))

    def starts_over(self, gpu: int) -> bool:
        """Whether `gpu`'s worker starts over at token 0 (launcher/pod/failed_resume.py)."""
        return starts_over(self.manifest, self.index, gpu)

    def restore_passed(self, gpus: list[int]) -> None:
        """A failed pod's manifest names no failed checkpoint (written when it changed)."""
        if restore_passed(self.manifest, self.index, self.events, gpus, refuse=False,
                          own_file_of=self.config.checkpoint_path):
            write_manifest(self.manifest)

    def record_baselines(self, stage: int, on_hub: set[int] = frozenset()) -> None:
        """A GPU with progress but no passed checkpoint (a pod this launcher never ran) trusts
        the one its entry names (recorded at `stage` when the entry has none). `on_hub` GPUs
        aside: their hub revision is the resume point."""
        for gpu in self.gpus:
            entry = self.manifest.entries.get(gpu)
            if not entry or not entry.checkpoint or gpu in on_hub or not self.never_passed(gpu):
                continue
            path = self.pod_dir / entry.checkpoint
            sha = entry.checkpoint_sha256 or sha256_file(path)
            event = {"sha256": sha, "next_token": entry.start_token, "phase": entry.at_phase,
                     "path": entry.checkpoint,
                     "ema_tf": entry.ema_tf, "lb": entry.lb,
                     "bytes": path.stat().st_size}
            reason = "launch baseline: the checkpoint the manifest names"
            if (gpu, sha) in self.index.records:
                self.index.mark(gpu, sha, PASSED, reason)
            else:
                self.index.add(gpu, event, entry.stage or stage, entry.checkpoint,
                               verdict=PASSED, reason=reason)

    # ---- what a GPU resumes from ------------------------------------------------------------
    def probe_name(self, record: dict, event: dict, rel: str) -> str | None:
        """The name an AR probe reads checkpoint `record` under (None: it cannot be probed)."""
        return self.copies.probe_name(record, event, rel)

    def restore(self, gpu: int) -> bool:
        """Before a restart: `gpu`'s entry names a file with its recorded bytes. True: the
        entry changed (the caller writes the manifest); RecoveryError: the bytes are nowhere."""
        return self.copies.restore(gpu, self.manifest, self.index)

    def rollback_target(self, gpu: int) -> dict | None:
        """The passed checkpoint a failed `gpu` goes back to (None: none is left)."""
        return (self.index.newest_passed(gpu)
                or self.copies.restore_point(gpu, self.launch_entries.get(gpu)))

    def resume_copy(self, gpu: int) -> dict | None:
        """What a GPU whose node was lost resumes from (its newest trustworthy hub copy)."""
        return self.copies.resume_copy(gpu)

    def node_probes(self):
        """Where AR probes run when the checkpoints are not here (None: on this machine)."""
        return self.copies.node_probes()

    # ---- pushes -----------------------------------------------------------------------------
    def manifest_changed(self, reason: str) -> None:
        """The manifest changed (a rollback, a stage or phase switch) or a merge round was
        decided (`reason` like "merge round 3 adopted"): pushed at the next tick, with the
        round's files (launcher/hub/round_files.py)."""
        if self.sync is not None:
            self.sync.manifest_changed(reason)

    def pump(self) -> None:
        """Once per poll, after the backend's: the nodes' pushes run and noted in the manifest."""
        self.copies.pump()
        self.note_pushed()

    def tick(self) -> None:
        """Once per poll, last: the hub sync's turn (it pushes in a thread, never blocking)."""
        if self.sync is not None:
            self.sync.tick()

    def note_pushed(self) -> None:
        """The nodes' pushes: each hub revision noted where the entry still names those bytes."""
        noted = []
        for copy in self.copies.take_pushed():
            gpu = copy["gpu"]
            if self.manifest.note_hub_revision(gpu, copy["hub_revision"], copy["sha256"]):
                noted.append(gpu)
            self.events.emit("sync_pushed", reason="node", gpu=gpu, node=copy.get("node"),
                             revision=copy["hub_revision"],
                             tokens={gpu: int(copy["next_token"])}, files=1,
                             hub_revision_for=[gpu] if gpu in noted else [])
        if noted:
            write_manifest(self.manifest)

    def close(self, abandoned: Callable[[], bool] = lambda: False) -> None:
        """Before the backend closes: the nodes' last pushes, unless `abandoned()`."""
        self.copies.close(abandoned)

    def finish(self, abandoned: Callable[[], bool] = lambda: False,
               signalled: bool = False) -> None:
        """After the backend closed: the nodes' pushes noted, then the hub sync's last push."""
        self.note_pushed()
        if self.sync is not None:
            self.sync.finish(abandoned=abandoned, signalled=signalled)


class LocalCopies:
    """The checkpoints on this machine: retained links in the pod, pushed by the hub sync."""
    on_nodes = False

    def __init__(self, pod_dir: Path, config: PodConfig, events: EventLog):
        self.pod_dir, self.config, self.events = pod_dir, config, events
        self.lease: RunLease | None = None

    def attach(self, lease: RunLease) -> None:
        """The custodian's lease: every push asks it, every refusal ends there."""
        self.lease = lease

    def probe_name(self, record: dict, event: dict, rel: str) -> str | None:
        return probe_name(record, self.pod_dir)

    def keep(self, gpu: int, record: dict) -> None:
        """What a passed checkpoint sets off: here nothing (the hub sync's next push takes it)."""

    def restore(self, gpu: int, manifest: Manifest, index: CheckpointIndex) -> bool:
        return recover_entry(self.pod_dir, gpu, manifest, index, self.events,
                             self.config.hub, self.config.checkpoint_path(gpu))

    def hub_copy(self, gpu: int) -> dict | None:
        """The newest passed checkpoint its node pushed: an index record + `hub_revision`."""
        return None

    def restore_point(self, gpu: int, launch: ManifestEntry | None) -> dict | None:
        """What a failed GPU rolls back to when no checkpoint of it passed here."""
        return self.hub_copy(gpu)

    def resume_copy(self, gpu: int) -> dict | None:
        return self.hub_copy(gpu)

    def take_pushed(self) -> list[dict]:
        """Checkpoints the nodes pushed since the last call: hub_copy records plus "node"."""
        return []

    def node_probes(self):
        return None

    def pump(self, force: bool = False) -> None:
        """Once per poll: start and collect the nodes' pushes."""

    def close(self, abandoned=lambda: False) -> None:
        """The run ended: the nodes' last pushes go up."""


class NodeCopies(LocalCopies):
    """The checkpoints on the workers' nodes: each retains, recovers, pushes, probes its own."""
    on_nodes = True

    def probe_name(self, record: dict, event: dict, rel: str) -> str | None:
        # The node names the checkpoint by its sha256 (and checks it); one its node could
        # not retain is not probed (as probe_name says on one machine).
        return rel if event.get("retained", True) else None

    def restore(self, gpu: int, manifest: Manifest, index: CheckpointIndex) -> bool:
        # The node does it as it starts the worker (launcher/supervise/ray/node.py).
        return False

    def restore_point(self, gpu: int, launch: ManifestEntry | None) -> dict | None:
        # The passed file is on a node's disk: its hub copy serves, else the checkpoint the
        # GPU resumed from at launch when the hub holds it.
        return self.hub_copy(gpu) or launch_point(launch)


def launch_point(entry: ManifestEntry | None) -> dict | None:
    """The checkpoint a GPU resumed from at launch, as a rollback target, when a hub revision
    holds it (so a node can pull it); else None."""
    if entry is None or not (entry.checkpoint and entry.hub_revision):
        return None
    return {"next_token": entry.start_token, "phase": entry.at_phase, "path": entry.checkpoint,
            "sha256": entry.checkpoint_sha256, "hub_revision": entry.hub_revision,
            "ema_tf": entry.ema_tf, "lb": entry.lb}


def probe_name(record: dict, pod_dir) -> str | None:
    """The name under which a running worker's checkpoint can be probed: its retained link
    (bytes pinned). None when it has none although it lies in the pod (its own name may hold
    newer bytes by now). A file outside the pod is never linked: its own name is all there is."""
    if record.get("retained"):
        return record["retained"]
    try:
        resolve_in_pod(record["path"], pod_dir)
    except ValueError:
        return record["path"]
    return None
