"""Bounded hub storage, run after every push (launcher and `sync push`): the hub keeps only
the checkpoint objects the `retention:` policy keeps (plus whatever the pushed and the pod's
own manifest name), and an object no revision names yet (a concurrent push's upload) is never
touched. Policy, deletion and ledger: docs/LAUNCHER.md "Bounded storage on the hub"."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from launcher.config.retention_settings import RetentionSettings, human_bytes

from .integrity import HubError
from .retention_ledger import (History, RevisionFacts, after_push, pushed_facts, read_history,
                               record)
from .sync_state import update_sync_state
from launcher.pod.ckpt_index import PASSED, PENDING, CheckpointIndex
from launcher.errors import UserError
from . import snapshot     # snapshot.send looked up at each push (tests fail it there)
from .redact import describe_error
from launcher.pod.manifest import ManifestError, read_manifest


class BudgetRefused(HubError):
    """A push would make the hub hold more than `retention.budget`: not sent."""


@dataclass
class Plan:
    revisions: list[str]                              # every revision, newest first
    kept: dict[str, str] = field(default_factory=dict)    # revision -> why it is kept
    needed: set[str] = field(default_factory=set)         # objects no deletion may touch
    delete: dict[str, int] = field(default_factory=dict)  # sha256 -> size, to delete now
    stored: dict[str, int] = field(default_factory=dict)  # named objects held before deletion
    facts: dict[str, RevisionFacts] = field(default_factory=dict)

    @property
    def kept_bytes(self) -> int:
        return sum(size for sha, size in self.stored.items() if sha not in self.delete)


# ---- the policy ---------------------------------------------------------------------------
def plan(history: History, settings: RetentionSettings, pod_dir: Path,
         protected: set[str] = frozenset()) -> Plan:
    """What the policy keeps and deletes now (nothing is deleted here). `protected`:
    sha256 of objects the pod's manifest names, never deleted."""
    revisions, facts = history.revisions, history.facts
    out = Plan(revisions, stored=history.stored, facts=facts)
    pushes = _pushes(revisions, facts)
    for rev in pushes[:settings.keep]:
        out.kept[rev] = f"one of the newest {settings.keep}"
    for pin in settings.pins:
        for rev in revisions:
            if rev.startswith(pin):
                out.kept.setdefault(rev, "pinned")
    if settings.milestones:
        # A GPU's stage changed after `older` (a switch, or a rollback): `older` is the
        # last push of its stage. Per GPU: one GPU still at its old checkpoint keeps the
        # pod's lowest stage unchanged while the others moved on. The same for data
        # phases: `older` holds the checkpoints that ended a phase.
        for newer, older in zip(pushes, pushes[1:]):
            stages, phases = facts[older].stages, facts[older].phases
            if stages and facts[newer].stages != stages:
                out.kept.setdefault(older, f"end of stage {max(stages)}")
            if phases and facts[newer].phases != phases:
                out.kept.setdefault(older, f"end of phase {max(phases)}")
        # The commit that carried a newly adopted merge round (its outer state, its merged
        # weights and the checkpoints they were merged from).
        for rev, parent in zip(revisions, [*revisions[1:], None]):
            if facts[rev].round > (facts[parent].round if parent else 0):
                out.kept.setdefault(rev, f"merge round {facts[rev].round}")
        out.needed.update(f.merged for f in facts.values() if f.merged)
    for rev in out.kept:
        out.needed.update(facts[rev].objects)
    out.needed.update(protected)
    recovery = {sha for f in facts.values() for sha in f.recovery}
    if revisions:                    # the newest recovery copy of each GPU, no older one
        out.needed.update(facts[revisions[0]].recovery)
    if recovery:       # ... and the bytes a node may still push as a passed checkpoint
        out.needed.update(recovery & awaiting_push(pod_dir))
    # Only objects some revision names are in `stored`: never one a concurrent push
    # uploaded and has not committed yet.
    out.delete = {sha: size for sha, size in out.stored.items() if sha not in out.needed}
    return out


def awaiting_push(pod_dir: Path) -> set[str]:
    """sha256 a Ray node may still push as passed (unjudged, or a GPU's two newest passed:
    queued and in flight). Their recovery copies are on the hub and the push sends no bytes:
    deleted meanwhile, it would commit a name for bytes the hub no longer holds."""
    index = CheckpointIndex(pod_dir)
    live = set()
    for gpu in {g for g, _sha in index.records}:
        records = index.for_gpu(gpu)
        live.update(r["sha256"] for r in records if r["verdict"] == PENDING)
        live.update(r["sha256"] for r in [r for r in records if r["verdict"] == PASSED][-2:])
    return live


def _pushes(revisions: list[str], facts: dict[str, RevisionFacts]) -> list[str]:
    """Revisions (newest first) whose checkpoints differ from their parent's: one per push."""
    out = []
    for rev, parent in zip(revisions, [*revisions[1:], None]):
        objects = facts[rev].objects
        if objects and (parent is None or objects != facts[parent].objects):
            out.append(rev)
    return out


def deleted_revisions(todo: Plan) -> set[str]:
    """Revisions missing some checkpoint object once `todo.delete` is applied."""
    held = set(todo.stored) - set(todo.delete)
    return {rev for rev, f in todo.facts.items() if any(sha not in held for sha in f.objects)}


def refuse_deleted(store, revision: str, tracked: dict, paths: list[str]) -> None:
    """UserError before any pull when retention deleted the revision's checkpoints."""
    wanted = {tracked[p].sha256 for p in paths if p in tracked}
    if not wanted:
        return
    gone = wanted - set(store.stored_objects())
    if gone:
        raise UserError(f"revision {revision[:12]} of {store.url}: its checkpoints were "
                        f"deleted by the hub's retention policy; `fractus-pod sync history` "
                        f"lists the revisions that still rebuild a pod")


# ---- around a push ------------------------------------------------------------------------
@dataclass(frozen=True)
class Pushed:
    revision: str
    storage: dict | None = None          # the figures for sync_state + the event's fields
    retention_error: str | None = None   # a failed retention step (the push still landed)


def push_with_retention(store, settings: RetentionSettings | None, snap, message: str,
                        manifest_path: str) -> Pushed:
    """`send` under the policy: budget first (BudgetRefused, nothing sent), then delete what
    it no longer keeps. A failed deletion never fails the push (retried after the next)."""
    if settings is None:
        return Pushed(snapshot.send(store, snap, message))
    check_budget(store, settings, {sha: snap.files[path].stat().st_size
                                   for path, sha in snap.pushed.values() if path in snap.files})
    revision = snapshot.send(store, snap, message)
    started = time.monotonic()      # all the step adds to the push, reading facts included
    try:
        history = after_push(store, store.pod_dir, manifest_path, revision,
                             pushed_facts(store, revision, snap.manifest))
        protected = {sha for _path, sha in snap.pushed.values()}
        protected |= named_by_pod_manifest(store.pod_dir / manifest_path)
        return Pushed(revision, apply_retention(store, settings, store.pod_dir, history,
                                                protected, started))
    except (HubError, OSError) as exc:
        return Pushed(revision, retention_error=describe_error(exc))


def named_by_pod_manifest(path: Path) -> set[str]:
    """sha256 the pod's manifest names (older bytes after a rollback; a recovery pulls them)."""
    try:
        manifest = read_manifest(path)
    except (ManifestError, OSError):
        return set()
    return {e.checkpoint_sha256 for e in manifest.entries.values() if e.checkpoint_sha256}


def apply_retention(store, settings: RetentionSettings, pod_dir: Path, history: History,
                    protected: set[str], started: float) -> dict:
    """Delete what the policy drops (one call, or none), record the ledger; return the storage
    figures and `hub_retention` fields. `started`: time.monotonic() at the step's start."""
    todo = plan(history, settings, pod_dir, protected)
    held = None              # a deletion that fails leaves what the hub holds unknown
    try:
        if todo.delete:
            store.delete_objects(sorted(todo.delete))
        held = {sha: size for sha, size in todo.stored.items() if sha not in todo.delete}
    finally:
        record(store, pod_dir, history, held)
    storage = storage_figures(todo, settings)
    return {**storage, "kept_revisions": sorted(r[:12] for r in todo.kept),
            "deleted_objects": len(todo.delete), "freed_bytes": sum(todo.delete.values()),
            "listed": history.listed,
            "retention_seconds": round(time.monotonic() - started, 4)}


def storage_figures(todo: Plan, settings: RetentionSettings | None) -> dict:
    """Bytes kept, bytes per push (the head's checkpoints), pushes until the budget."""
    per_push = sum(todo.facts[todo.revisions[0]].objects.values()) if todo.revisions else 0
    kept = todo.kept_bytes
    budget = settings.budget_bytes if settings else None
    return {"hub_bytes_kept": kept, "hub_bytes_per_push": per_push, "hub_budget_bytes": budget,
            "hub_pushes_until_budget": pushes_until_budget(kept, per_push, settings)}


def pushes_until_budget(kept: int, per_push: int, settings: RetentionSettings | None):
    """How many more pushes fit: None when no budget is set, "unbounded" when retention
    frees as much as each push adds and the peak (kept + one push) fits."""
    if settings is None or settings.budget_bytes is None or per_push <= 0:
        return None
    if kept + per_push <= settings.budget_bytes:
        return "unbounded"
    return max(0, (settings.budget_bytes - kept) // per_push)


def check_budget(store, settings: RetentionSettings | None, sizes: dict[str, int]) -> None:
    """BudgetRefused when pushing `sizes` (sha256 -> bytes) would exceed the budget; one
    smaller than a push is named as such (a launch refuses it earlier, when it can)."""
    if settings is None or settings.budget_bytes is None:
        return
    budget = settings.budget_bytes
    too_small = settings.below_one_push(sum(sizes.values()), "checked at the first push")
    if too_small:
        raise BudgetRefused(too_small)
    stored = store.stored_objects()
    new = sum(size for sha, size in sizes.items() if sha not in stored)
    if sum(stored.values()) + new > budget:
        raise BudgetRefused(
            f"push refused: the hub would hold {human_bytes(sum(stored.values()) + new)}, "
            f"over retention.budget {human_bytes(budget)}; lower retention.keep, unpin "
            f"revisions or raise the budget (the pod keeps training)")


# ---- what the pod records --------------------------------------------------------------
STATE_KEYS = ("hub_bytes_kept", "hub_bytes_per_push", "hub_budget_bytes",
              "hub_pushes_until_budget")


def storage_state(pushed: Pushed) -> dict:
    """The storage figures for the push's own sync_state write (one write per push)."""
    return {} if pushed.storage is None else {k: pushed.storage[k] for k in STATE_KEYS}


def retention_events(pushed: Pushed) -> list[tuple[str, dict]]:
    """Retention's events, appended with the push's `sync_pushed` (one fsync per push)."""
    out = []
    if pushed.storage is not None:
        out.append(("hub_retention", {k: v for k, v in pushed.storage.items()
                                      if k not in STATE_KEYS or k == "hub_bytes_kept"}))
    if pushed.retention_error is not None:
        out.append(("hub_retention_failed", {"error": pushed.retention_error,
                                             "retry": "after the next push"}))
    return out


def record_budget_refused(pod_dir: Path, events, message: str, reason: str, retry: str) -> None:
    """A push the budget refused: said in status (last error) and as an event."""
    update_sync_state(pod_dir, in_flight=False, last_error=message, last_error_at=time.time(),
                      last_result="budget_refused")
    events.emit("hub_budget_refused", reason=reason, error=message, retry=retry)


# ---- `sync history` ------------------------------------------------------------------------
def history_marks(store, settings: RetentionSettings, pod_dir: Path,
                  manifest_path: str) -> tuple[dict[str, str], str]:
    """Per revision: why it is kept, or that its checkpoints are gone; and the storage line."""
    history = read_history(store, pod_dir, manifest_path)
    todo = plan(history, settings, pod_dir)
    todo.delete = {}             # what the hub holds now, not what the next push frees
    record(store, pod_dir, history, dict(history.stored))
    marks = {rev: "checkpoints deleted: cannot rebuild a pod" for rev in deleted_revisions(todo)}
    marks.update({rev: f"kept: {why}" for rev, why in todo.kept.items() if rev not in marks})
    return marks, storage_line(storage_figures(todo, settings))


def storage_line(figures: dict) -> str:
    """One line a person reads: status and `sync history` alike."""
    line = (f"hub storage: {human_bytes(figures['hub_bytes_kept'])} kept, "
            f"{human_bytes(figures['hub_bytes_per_push'])} per push")
    budget = figures.get("hub_budget_bytes")
    if budget:
        left = figures.get("hub_pushes_until_budget")
        line += (f", budget {human_bytes(budget)}: "
                 + ("retention keeps it within the budget" if left == "unbounded"
                    else f"{left} more push(es) fit"))
    return line
