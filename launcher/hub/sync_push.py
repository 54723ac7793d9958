"""`fractus-pod sync push`: the launcher's push, by hand (launcher/hub/sync.py decides what a
push holds). A push of what the hub's head already holds (the same checkpoints, the same
manifest, the same merge round files) is skipped, not committed again; a changed manifest
alone (a rollback) is pushed."""

from __future__ import annotations

import time
from pathlib import Path

from launcher.files import sha256_file
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.events import EventLog
from launcher.pod.manifest import write_manifest
from launcher.config.podconfig import PodConfig
from launcher.hub.redact import describe_error
from launcher.hub.retention import (BudgetRefused, Pushed, push_with_retention,
                                    record_budget_refused, retention_events, storage_state)
from launcher.hub.snapshot import Snapshot, record_revision, take_snapshot
from launcher.hub.sync import (
    HubSync,
    record_taken_over,
    refuse_vanished_store,
    store_for,
)
from launcher.hub.sync_state import update_sync_state
from launcher.hub.lease import RunTakenOver, hub_lease, pod_id
from launcher.errors import UserError
from launcher.pod.lock import PodLock, read_holder
from launcher.pod.manifest import read_manifest


def already_pushed(store, snap: Snapshot) -> str | None:
    """The head when it already holds exactly the snapshot's checkpoints and manifest, and
    names no round file the push would drop (a hub pushed before drops were)."""
    head = store.head()
    if head is None:
        return None
    lease = hub_lease(store, head)
    if lease is not None and lease["pod_id"] != pod_id(store.pod_dir):
        return None        # another pod's run: the push must say so, not skip
    held = store.files(head)
    wanted = [*snap.pushed.values(), (snap.manifest_path, snap.manifest_sha256()),
              *((rel, sha256_file(path)) for rel, path in snap.rounds.items())]
    same = all(held.get(path) is not None and held[path].sha256 == sha
               for path, sha in wanted)
    drop = snap.drop()
    stale = drop is not None and any(drop(path) and path not in snap.rounds for path in held)
    return head if same and not stale else None


def push_now(pod_dir: Path, config: PodConfig,
             message: str) -> tuple[str, list[int], bool]:
    """The launcher's push by hand (with a launcher running, only the push: the manifest is
    its own). Returns (revision, GPUs whose hub_revision was recorded, skipped?)."""
    running = read_holder(pod_dir) is not None
    lock = None if running else PodLock(pod_dir)
    if lock is not None:
        lock.acquire()
    try:
        manifest = read_manifest(pod_dir / config.manifest)
        snap = take_snapshot(pod_dir, config, manifest, CheckpointIndex(pod_dir),
                             config.sync_settings().merge)
        if snap is None:
            raise UserError("no checkpoint has passed its checks yet: nothing to push")
        store = store_for(config, pod_dir)
        try:
            refuse_vanished_store(store, pod_dir, config.hub)
            unchanged = already_pushed(store, snap)
            pushed = Pushed(unchanged) if unchanged else push_with_retention(
                store, config.retention_settings(), snap, message, config.manifest)
            revision = pushed.revision
        except Exception as exc:
            if isinstance(exc, RunTakenOver):
                record_taken_over(pod_dir, EventLog(pod_dir), str(exc), "by hand")
            elif isinstance(exc, BudgetRefused):    # the user's limit: exit 2, one line
                record_budget_refused(pod_dir, EventLog(pod_dir), str(exc), "by hand", "none")
                raise UserError(str(exc)) from None
            else:
                update_sync_state(pod_dir, last_error=describe_error(exc),
                                  last_error_at=time.time(), last_result="error")
            raise
        finally:
            snap.discard()
        noted = [] if running else record_revision(manifest, snap, revision)
        if noted:
            write_manifest(manifest)
        if not running:      # the hub holds the manifest now (a launcher clears its own)
            update_sync_state(pod_dir, manifest_unpushed=None)
        if unchanged:
            EventLog(pod_dir).emit("sync_skipped", reason="by hand", revision=revision,
                                   why="the hub's head already holds these checkpoints "
                                       "and this manifest")
            return revision, noted, True
        update_sync_state(pod_dir, last_revision=revision, last_revision_hub=config.hub,
                          last_success_at=time.time(),
                          last_result="ok", taken_over=None, last_pushed_tokens={
                              g: HubSync.manifest_token(snap, g) for g in snap.pushed},
                          **storage_state(pushed))
        EventLog(pod_dir).emit_all([("sync_pushed", dict(
            reason="by hand", revision=revision, files=len(snap.files),
            hub_revision_for=noted)), *retention_events(pushed)])
        return revision, noted, False
    finally:
        if lock is not None:
            lock.release()

