"""The hub sync policy: what goes up, when, and what the pod remembers about it. Owner: the
checkpoint custodian (launcher/supervise/custodian.py), whose private part it is.

ONE push in flight at a time: the loop only takes a snapshot (hard links) and never blocks;
a background thread pushes and the loop harvests the result into the manifest and
logs/sync_state.json. Every push asks the run's one lease (`RunLease`) first. What and when:
docs/LAUNCHER.md "Hub" ("What a sync pushes", "When")."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from launcher.paths import SNAPSHOT_DIR
from launcher.hub.sync_state import read_sync_state, update_sync_state
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest, write_manifest
from launcher.config.podconfig import PodConfig
from launcher.hub.redact import describe_error
from launcher.hub.retention import record_budget_refused, retention_events, storage_state
from launcher.hub.snapshot import (Snapshot, record_revision, take_manifest_snapshot,
                                   take_snapshot)
from launcher.hub import HubError
from launcher.hub import open_store
from launcher.hub import RetryPolicy
from launcher.hub.lease import RunTakenOver
from launcher.hub.retention import BudgetRefused, push_with_retention
from launcher.hub.retry import RateLimited

# ---- the sync state file (read by status) ------------------------------------------------
def note_manifest_changed(pod_dir: Path, reason: str) -> None:
    """Record (durably) a manifest change no running sync can push now: the next launcher
    pushes it at its first poll, a `sync push` by hand clears it."""
    update_sync_state(pod_dir, manifest_unpushed={"reason": reason, "at": time.time()})


def refuse_vanished_store(store, pod_dir: Path, hub: str) -> None:
    """HubError if a store this pod pushed to is now empty: a push would recreate it empty,
    and the revisions the manifest records could never be pulled again."""
    state = read_sync_state(pod_dir)
    last = state.get("last_revision")
    if not last or state.get("last_revision_hub") != hub or store.head() is not None:
        return
    raise HubError(f"hub {hub} held this pod's revisions (last {str(last)[:12]}) and is now "
                   f"empty or gone; restore it, or set hub: to a new store (then "
                   f"`fractus-pod sync push` starts it)")


def store_for(config: PodConfig, pod_dir: Path):
    """The pod's hub store with its sync retry policy. ValueError for a malformed URL."""
    return open_store(config.hub, pod_dir, retry=retry_policy(config))


def retry_policy(config: PodConfig):
    """How hard one hub call insists (sync: attempts, backoff_s); data store reads too."""
    settings = config.sync_settings()
    return RetryPolicy(attempts=settings.attempts, base_delay_s=settings.backoff_s,
                       max_delay_s=max(settings.backoff_s, 30.0))


# ---- the policy, driven by the supervisor --------------------------------------------------
class HubSync:
    """`tick()` on every poll (never blocks); `finish()` once the workers stopped (blocks)."""

    def __init__(self, pod_dir: Path, config: PodConfig, manifest: Manifest,
                 index: CheckpointIndex, events: EventLog, lease: RunLease):
        self.pod_dir, self.config, self.manifest = pod_dir, config, manifest
        self.index, self.events = index, events
        self.settings = config.sync_settings()
        self.store = store_for(config, pod_dir)
        self.next_due = time.monotonic() + self.settings.interval_s
        self.hold_until = 0.0        # monotonic: the hub rate-limits pushes until then
        self._thread: threading.Thread | None = None
        self._job: tuple | None = None            # (snapshot, reason, started, changes)
        # ("ok", Pushed), ("error" | "budget" | "taken_over", message)
        self._outcome: tuple | None = None
        self.retention = config.retention_settings()
        self._last_key: tuple | None = None       # of the last push that landed
        self._tried_key: tuple | None = None      # of the last manifest push started
        self.lease = lease           # shared with the custodian's node pushes
        # A manifest change not yet landed: a push taken at change N lands changes up to N only.
        unpushed = read_sync_state(pod_dir).get("manifest_unpushed") or {}
        self.unpushed_change: str | None = unpushed.get("reason")
        self._changes = 1 if self.unpushed_change else 0
        self._changes_started = 0
        # A remote backend's nodes push the checkpoints: gpu -> the pushed record.
        self.node_pushes: Callable[[], dict[int, dict]] | None = None
        shutil.rmtree(pod_dir / SNAPSHOT_DIR, ignore_errors=True)   # a dead launcher's
        update_sync_state(pod_dir, hub=config.hub, interval_s=self.settings.interval_s,
                          in_flight=False)
        if config.hub.startswith("file://"):    # a local check is free: say it at launch
            try:
                refuse_vanished_store(self.store, pod_dir, config.hub)
            except HubError as exc:
                update_sync_state(pod_dir, last_error=str(exc), last_error_at=time.time(),
                                  last_result="error")
                events.emit("sync_failed", reason="launch", error=str(exc), retry="every push")

    @property
    def busy(self) -> bool:
        return self._thread is not None

    @property
    def taken_over(self) -> str | None:
        """Another pod writes the run (the refusal's one line): no more pushes."""
        return self.lease.taken_over

    def nodes_push(self, on_hub: Callable[[], dict[int, dict]]) -> None:
        """Nodes push the checkpoints (`on_hub()`: gpu -> newest pushed index record); this
        sync pushes only the manifest naming them, once per change."""
        self.node_pushes = on_hub

    def manifest_changed(self, reason: str) -> None:
        """Push at the next tick, whatever the interval (recorded until landed): a changed
        manifest, or a decided merge round (its files ride every push: snapshot.py)."""
        self.unpushed_change, self._changes = reason, self._changes + 1
        note_manifest_changed(self.pod_dir, reason)

    def tick(self) -> None:
        self._harvest()
        if self.busy or self.taken_over or time.monotonic() < self.hold_until:
            return
        if self.unpushed_change is not None and (
                self._changes != self._changes_started or time.monotonic() >= self.next_due):
            # At once for a new change; one whose push failed is retried at the interval.
            self._changes_started = self._changes
            self.next_due = time.monotonic() + self.settings.interval_s
            self._start(self.unpushed_change)
        elif self.node_pushes is not None:       # a node pushed: the manifest follows it
            on_hub = self.node_pushes()
            key = self._pushed_key(on_hub)
            # Nothing on the hub yet: nothing to name. A key that failed is retried at the
            # interval, not on every poll (a hub that is down would be hammered).
            if on_hub and key != self._last_checkpoints() and (
                    key != self._tried_key or time.monotonic() >= self.next_due):
                self._tried_key = key
                self.next_due = time.monotonic() + self.settings.interval_s
                self._start("manifest")
        elif time.monotonic() >= self.next_due:
            self.next_due = time.monotonic() + self.settings.interval_s
            self._start("interval")

    def _last_checkpoints(self) -> tuple | None:
        return self._last_key[0] if self._last_key else None

    def _pushed_key(self, on_hub: dict[int, dict]) -> tuple:
        """Snapshot.checkpoints_key() of the push naming `on_hub`, without a snapshot."""
        return tuple(sorted((gpu, (self.config.checkpoint_path(gpu), r["sha256"]))
                            for gpu, r in on_hub.items())), False

    def finish(self, abandoned: Callable[[], bool] = lambda: False,
               signalled: bool = False) -> None:
        """Wait for a push in flight, then push once more. A dead hub can hold this for
        minutes: once `abandoned()` (a second signal) the push is given up and recorded as
        failed. `signalled`: only then does the line say a signal abandons it."""
        if not self._wait(abandoned) or self.taken_over:
            return
        if abandoned():
            self._record_abandoned("stop", time.time(), "abandoned before it started: a "
                                                        "second signal")
            return
        self._start("stop")
        if self._thread is not None:
            print(f"fractus-pod: final push to {self.config.hub}"
                  + (" (signal again to abandon it)" if signalled else ""),
                  file=sys.stderr, flush=True)
        if not self._wait(abandoned):
            return
        if self.taken_over:          # the line above promised a push: say how it ended
            print(f"fractus-pod: final push to {self.config.hub} REFUSED: {self.taken_over}",
                  file=sys.stderr, flush=True)
        try:
            (self.pod_dir / SNAPSHOT_DIR).rmdir()    # only when no other push is using it
        except OSError:
            pass

    def _wait(self, abandoned: Callable[[], bool]) -> bool:
        """Until the push in flight ends (then harvested: True) or is abandoned (False)."""
        while self._thread is not None and self._thread.is_alive():
            if abandoned():
                _snap, reason, started, _changes = self._job
                self._record_abandoned(reason, started, "abandoned: a second signal arrived "
                                                        "while it was pushing")
                return False      # the daemon thread dies with the process; the pod is intact
            self._thread.join(0.2)
        self._harvest()
        return True

    def _record_abandoned(self, reason: str, started: float, error: str) -> None:
        update_sync_state(self.pod_dir, in_flight=False, last_error=error,
                          last_error_at=time.time(), last_result="error")
        self.events.emit("sync_failed", reason=reason, error=error, retry="none",
                         seconds=round(time.time() - started, 2))

    def _start(self, reason: str) -> None:
        if self.node_pushes is not None:
            # The merged brain is read back from the hub (every GPU's checkpoint, one at a
            # time): once, at the end of the run, not after each node's push.
            snap = take_manifest_snapshot(self.pod_dir, self.config, self.manifest,
                                          self.node_pushes(),
                                          merge=self.settings.merge and reason == "stop")
        else:
            snap = take_snapshot(self.pod_dir, self.config, self.manifest, self.index,
                                 self.settings.merge)
        if snap is None or snap.key() == self._last_key:
            if snap is not None:
                snap.discard()
            self.events.emit("sync_skipped", reason=reason,
                             why="no passed checkpoint yet" if snap is None
                             else "nothing new since the last push")
            self._landed(self._changes)      # nothing the hub lacks
            return
        # The snapshot holds the manifest as it is now: every change asked so far.
        self._job = (snap, reason, time.time(), self._changes)
        update_sync_state(self.pod_dir, in_flight=True, last_attempt_at=time.time())
        message = (f"fractus-pod sync ({reason}): " + ", ".join(
            f"gpu{g}@{self.manifest_token(snap, g):,}" for g in sorted(snap.pushed)))
        self._thread = threading.Thread(target=self._run, args=(snap, message),
                                        name="hub-sync", daemon=True)
        self._thread.start()

    @staticmethod
    def manifest_token(snap: Snapshot, gpu: int) -> int:
        return int(snap.manifest_doc[f"gpu_{gpu}"]["start_token"])

    def _run(self, snap: Snapshot, message: str) -> None:
        try:
            refuse_vanished_store(self.store, self.pod_dir, self.config.hub)
            self._outcome = ("ok", push_with_retention(
                self.store, self.retention, snap, message, self.config.manifest))
        except RunTakenOver as exc:   # another pod writes the run: this one stops pushing
            self._outcome = ("taken_over", str(exc))
        except BudgetRefused as exc:  # over retention.budget: nothing sent, training goes on
            self._outcome = ("budget", str(exc))
        except RateLimited as exc:    # delayed, not given up: again when the hub said
            self._outcome = ("rate_limited", (str(exc), exc.retry_at))
        except Exception as exc:      # any failure: recorded, retried next interval
            self._outcome = ("error", describe_error(exc))

    def _harvest(self) -> None:
        """On the supervision loop: apply a finished push's result."""
        if self._thread is None or self._thread.is_alive():
            return
        self._thread = None
        (snap, reason, started, changes), self._job = self._job, None
        kind, value = self._outcome or ("error", "the sync thread ended without a result")
        self._outcome = None
        snap.discard()
        seconds = round(time.time() - started, 2)
        tokens = {g: self.manifest_token(snap, g) for g in sorted(snap.pushed)}
        if kind == "ok":
            pushed, value = value, value.revision
            self._last_key = snap.key()
            self._landed(changes)
            noted = record_revision(self.manifest, snap, value)
            if noted:
                write_manifest(self.manifest)
            update_sync_state(self.pod_dir, in_flight=False, last_revision=value,
                              last_revision_hub=self.config.hub,
                              last_success_at=time.time(), last_pushed_tokens=tokens,
                              last_result="ok", taken_over=None, delayed_until=None,
                              **storage_state(pushed))
            self.events.emit_all([("sync_pushed", dict(
                reason=reason, revision=value, tokens=tokens, files=len(snap.files),
                seconds=seconds, hub_revision_for=noted)), *retention_events(pushed)])
        elif kind == "budget":
            record_budget_refused(self.pod_dir, self.events, value, reason,
                                  "at the next interval" if reason in ("interval", "manifest")
                                  else "none")
        elif kind == "taken_over":
            self.lease.refused(value, reason)
        elif kind == "rate_limited" and reason != "stop":
            message, retry_at = value
            self.hold_until = time.monotonic() + max(0.0, retry_at - time.time())
            self.next_due = self.hold_until
            self._tried_key = None          # a node push's manifest is tried again too
            update_sync_state(self.pod_dir, in_flight=False, last_error=message,
                              last_error_at=time.time(), last_result="delayed",
                              delayed_until=retry_at)
            self.events.emit("sync_delayed", reason=reason, error=message, seconds=seconds,
                             retry_at=round(retry_at, 3))
        else:
            value = value[0] if kind == "rate_limited" else value   # the stop push: given up
            update_sync_state(self.pod_dir, in_flight=False, last_error=value,
                              last_error_at=time.time(), last_result="error")
            self.events.emit("sync_failed", reason=reason, error=value, seconds=seconds,
                             retry="none" if reason == "stop" else "at the next interval")

    def _landed(self, changes: int) -> None:
        """The hub holds the manifest as of change number `changes`."""
        if self.unpushed_change is not None and changes == self._changes:
            self.unpushed_change = None
            update_sync_state(self.pod_dir, manifest_unpushed=None)


class RunLease:
    """The run's hub lease as this launcher knows it (launcher/hub/lease.py): `taken_over`
    None while it may push, else the refusal's line, recorded once. One per launcher."""

    def __init__(self, pod_dir: Path, events: EventLog):
        self.pod_dir, self.events = pod_dir, events
        self.taken_over: str | None = None

    def refused(self, message: str, reason: str) -> None:
        if self.taken_over is None:
            self.taken_over = message
            record_taken_over(self.pod_dir, self.events, message, reason)


def record_taken_over(pod_dir: Path, events: EventLog, message: str, reason: str) -> None:
    """Another pod holds the run's lease: said in events and status."""
    update_sync_state(pod_dir, in_flight=False, taken_over=message, last_error=message,
                      last_error_at=time.time(), last_result="taken_over")
    events.emit("hub_taken_over", reason=reason, error=message, retry="none: pushes stop")
