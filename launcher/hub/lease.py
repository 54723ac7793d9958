"""One writer per hub run: the hub holds `LEASE_PATH` (writer pod id, epoch, when taken).
Every push carries it, built on the head it was read from, so a takeover landing in between
makes the push conflict instead of both pods winning; `launch --from-hub` takes it over
(epoch + 1) and the old pod's next push raises RunTakenOver. A pod's id lives in the pod
(`HELD_FILE`), never in the hub's config: a rebuilt pod is a new pod."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping

from launcher.paths import HELD_FILE
from launcher.hub import HubError, PushConflict
from launcher.hub.retry_loop import attempts, retrying
from launcher.files import atomic_write_text

LEASE_PATH = "fractus-pod.lease.json"    # in the hub: which pod writes this run
# Pushes of one writer that conflict with each other (the lease unchanged) are retried on
# the new head this many times in all: several GPUs pushing at once settle in a few.
SAME_WRITER_ATTEMPTS = 5


class RunTakenOver(HubError):
    """Another pod holds the run's lease: this pod must not push to it any more."""


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def held_pod_id(pod_dir: Path) -> str | None:
    """This pod's id if it has one (None: it never pushed nor took a run over)."""
    held = _read_json(pod_dir / HELD_FILE)
    return held["pod_id"] if isinstance(held.get("pod_id"), str) and held["pod_id"] else None


def pod_id(pod_dir: Path) -> str:
    """This pod's id (host name and a random part), created on first use."""
    if (held := held_pod_id(pod_dir)) is not None:
        return held
    new = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
    (pod_dir / HELD_FILE).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(pod_dir / HELD_FILE, json.dumps({"pod_id": new}) + "\n")
    return new


def hub_lease(store, revision: str | None) -> dict | None:
    """The lease a revision records (None: an empty hub, or a run pushed before leases)."""
    if revision is None:
        return None
    raw = store.read_bytes(LEASE_PATH, revision)
    if raw is None:
        return None
    try:
        lease = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HubError(f"{store.url}: {LEASE_PATH} at {revision[:12]} is not JSON") from None
    if not isinstance(lease, dict) or not isinstance(lease.get("pod_id"), str):
        raise HubError(f"{store.url}: {LEASE_PATH} at {revision[:12]} names no pod")
    return lease


def taken_over_message(lease: dict) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(lease.get("taken_at", 0))))
    return (f"run taken over by pod {lease['pod_id']} at {when} (lease epoch "
            f"{lease.get('epoch')}): this pod no longer pushes to the hub")


def _stage(lease: dict, stage_dir: Path) -> Path:
    """The lease file to commit, uniquely named: a node's GPUs may push at once from one dir."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    path = stage_dir / f"lease-{uuid.uuid4().hex[:8]}.json"
    atomic_write_text(path, json.dumps(lease, indent=2, sort_keys=True) + "\n")
    return path


def _writers_lease(store, me: str | None) -> tuple[str | None, dict]:
    """(head to build on, lease to commit); RunTakenOver if another pod holds it there."""
    head = store.head()
    lease = hub_lease(store, head)
    if lease is not None and lease["pod_id"] != me:
        raise RunTakenOver(taken_over_message(lease))
    if lease is None:           # the run's first writer under leases
        lease = {"pod_id": me, "epoch": 1, "taken_at": time.time()}
    return head, lease


def refuse_if_taken_over(store, pod_dir: Path) -> None:
    """Before a launch trains: RunTakenOver if another pod holds the lease. Reads only (gives
    no id); a pod with no id and a lease on the hub is not its writer."""
    _writers_lease(store, held_pod_id(pod_dir))


def push_as_writer(store, files: Mapping[str, Path], message: str,
                   expected: Mapping[str, str] | None, stage_dir: Path, writer: str,
                   drop: Callable[[str], bool] | None = None) -> str:
    """`store.push` as the run's writer `writer` (a Ray node pushes as its head's pod):
    RunTakenOver if another pod holds the lease, before sending or when a takeover caused the
    conflict. A conflict with the same writer's push is rebuilt on the new head. `drop`: as
    `Store.push`'s."""
    def push() -> str:
        base, lease = _writers_lease(store, writer)     # RunTakenOver if the lease moved
        lease_file = _stage(lease, stage_dir)
        try:
            return store.push({**files, LEASE_PATH: lease_file}, message, base=base,
                              expected=expected, drop=drop)
        finally:
            lease_file.unlink(missing_ok=True)
    try:
        return retrying(push, attempts(SAME_WRITER_ATTEMPTS,
                                       lambda exc: isinstance(exc, PushConflict)))
    except PushConflict:
        _writers_lease(store, writer)   # a takeover made it conflict: RunTakenOver
        raise


def take_over(store, pod_dir: Path) -> dict:
    """This pod becomes the run's writer (epoch + 1), built on the head it read, so two pods
    taking over at once cannot both win."""
    me = pod_id(pod_dir)
    head = store.head()
    previous = hub_lease(store, head)
    lease = {"pod_id": me, "epoch": int((previous or {}).get("epoch", 0)) + 1,
             "taken_at": time.time(), "previous_pod": (previous or {}).get("pod_id")}
    stage_dir = pod_dir / "logs" / f".lease-{uuid.uuid4().hex[:8]}"
    try:
        store.push({LEASE_PATH: _stage(lease, stage_dir)},
                   f"fractus-pod: pod {me} takes over the run (lease epoch {lease['epoch']})",
                   base=head)
    finally:
        for child in stage_dir.glob("*"):
            child.unlink()
        stage_dir.rmdir()
    atomic_write_text(pod_dir / HELD_FILE, json.dumps({"pod_id": me, **lease}) + "\n")
    return lease
