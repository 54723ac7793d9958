"""The retention ledger `logs/hub_ledger.json`: what the hub's revisions name, in order, and
which checkpoint objects the hub held after the last retention step. A cache of the hub,
written only through launcher/hub/retention.py (after a push, and by `sync history`); the
hub stays the truth.

What each revision names (its checkpoint objects, stage, merged brain) never changes, so it
is read from the hub once and kept here (a cache: a pod rebuilt with `launch --from-hub`
reads it again from the revisions themselves). The revisions' order lets a push walk back
from the head only to the newest revision it knew. `held` (sha256 -> size) is what the step
left on the hub: written only when its deletion completed.

The file is a cache, rewritten in place after every push (no fsync, no temp file: replacing
the file frees the old one, and on a disk mounted with `discard` that unlink alone cost
~0.45 ms, more than the rest of the step; an in-place write ~4 us). Its first line is the
sha256 of the rest: a write a crash or a concurrent `sync history` tore reads as no ledger,
and the hub is read again (what a revision names is on the hub, never only here).

Two ways to the history a retention step decides on:
- after a push whose parent is the newest revision the ledger knows (this pod wrote every
  revision since the last step: no other pod, node or takeover committed in between) and
  with `held` recorded, the ledger alone, plus the push: no listing of commits or objects;
- otherwise (no ledger, another hub's, a damaged one, a failed deletion, another writer's
  commit), the hub is read: its revisions down to the newest one the ledger knew, and the
  objects it holds (hf://: `list_commits`, `list_lfs_files`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from launcher.paths import HUB_LEDGER, MERGED_PATH, RECOVERY_HUB_DIR
from launcher.pod.manifest import ManifestError, read_manifest

CHECKPOINT_SUFFIXES = (".pt", ".safetensors", ".bin")


@dataclass(frozen=True)
class RevisionFacts:
    """What one revision names: fixed once committed."""
    objects: dict[str, int]         # sha256 -> size of each checkpoint file it names
    stages: tuple[int, ...]         # the distinct stages its manifest's GPUs record
    merged: str | None              # sha256 of the merged brain it names, if any
    phases: tuple[int, ...] = ()    # the distinct data phases its manifest's GPUs are in
    # sha256 -> size of each recovery copy it names (not in `objects`: no push of its own)
    recovery: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"objects": self.objects, "stages": list(self.stages), "merged": self.merged,
                "phases": list(self.phases), "recovery": self.recovery}

    def named(self) -> set[str]:
        """Every object it names that retention may delete: checkpoints, recovery copies."""
        return {*self.objects, *self.recovery}

    @classmethod
    def from_json(cls, doc: dict) -> "RevisionFacts":
        """KeyError for an entry without a key (a ledger written before phases were
        recorded): it is read again from the hub, as a damaged one. One without recovery
        copies names none (entries before them were of revisions without any)."""
        objects = {str(k): int(v) for k, v in dict(doc["objects"]).items()}
        recovery = {str(k): int(v) for k, v in dict(doc.get("recovery") or {}).items()}
        return cls(objects, tuple(int(s) for s in doc["stages"]), doc.get("merged"),
                   tuple(int(p) for p in doc["phases"]), recovery)


@dataclass
class History:
    """The hub's revisions (newest first), their facts, and the checkpoint objects the hub
    holds that some revision names (sha256 -> size)."""
    revisions: list[str]
    facts: dict[str, RevisionFacts]
    stored: dict[str, int]
    listed: bool                    # read from the hub, not only from the ledger


def _facts(index: dict, stages: tuple[int, ...], phases: tuple[int, ...]) -> RevisionFacts:
    """A revision's facts from its index: checkpoint objects and recovery copies apart."""
    objects, recovery = {}, {}
    for path, e in index.items():
        if path.endswith(CHECKPOINT_SUFFIXES):
            (recovery if path.startswith(RECOVERY_HUB_DIR + "/") else objects)[e.sha256] = e.size
    return RevisionFacts(objects, stages, index[MERGED_PATH].sha256 if MERGED_PATH in index
                         else None, phases, recovery)


def revision_facts(store, revision: str, manifest_path: str) -> RevisionFacts:
    """Read from the hub: the revision's index and the stages its manifest records."""
    index = store.files_at(revision)
    stages: tuple[int, ...] = ()
    phases: tuple[int, ...] = ()
    if manifest_path in index:
        with store.fetched(manifest_path, revision) as local:
            try:
                manifest = read_manifest(local)
                stages, phases = tuple(manifest.recorded_stages()), \
                    tuple(manifest.recorded_phases())
            except ManifestError:
                pass                 # a manifest the launcher cannot read names no stage
    return _facts(index, stages, phases)


def pushed_facts(store, revision: str, manifest) -> RevisionFacts:
    """The facts of a revision this pod just pushed: its index (the store kept it from the
    push: nothing read back, not even resolved) and the stages of the manifest it sent."""
    return _facts(store.files_at(revision), tuple(manifest.recorded_stages()),
                  tuple(manifest.recorded_phases()))


def read_ledger(pod_dir: Path) -> dict:
    """The ledger as written; {} when it is missing, torn (its checksum line does not match)
    or not a mapping."""
    try:
        raw = (pod_dir / HUB_LEDGER).read_bytes()
    except FileNotFoundError:
        return {}
    checksum, _, body = raw.partition(b"\n")
    if hashlib.sha256(body).hexdigest().encode() != checksum:
        return {}
    try:
        doc = json.loads(body)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_ledger(pod_dir: Path, doc: dict) -> None:
    """In place (see the module's docstring): the checksum line, then the document."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    data = hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    path = pod_dir / HUB_LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.pwrite(fd, memoryview(data)[done:], done)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _read(store, pod_dir: Path) -> tuple[list[str], dict, dict | None]:
    """The ledger's order, facts (raw) and held objects, for this hub only."""
    doc = read_ledger(pod_dir)
    if doc.get("hub") != store.url:
        return [], {}, None
    order = doc.get("order")
    order = [str(rev) for rev in order] if isinstance(order, list) else []
    stored = doc.get("revisions")
    held = doc.get("held")
    return (order, dict(stored) if isinstance(stored, dict) else {},
            held if isinstance(held, dict) else None)


def after_push(store, pod_dir: Path, manifest_path: str, revision: str,
               facts: RevisionFacts) -> History:
    """The history right after this pod pushed `revision`: from the ledger alone when it
    knew the push's parent (see the module's docstring), else read from the hub."""
    order, stored, held = _read(store, pod_dir)
    parent = store.parents.get(revision)
    if held is not None and order and parent == order[0]:
        try:
            known = {rev: RevisionFacts.from_json(stored[rev]) for rev in order}
            on_hub = {str(sha): int(size) for sha, size in held.items()}
        except (KeyError, TypeError, ValueError):
            known = None             # a damaged ledger: the hub is read instead
        if known is not None:
            return History([revision, *order], {revision: facts, **known},
                           {**on_hub, **facts.objects, **facts.recovery}, listed=False)
    return read_history(store, pod_dir, manifest_path, {revision: facts})


def read_history(store, pod_dir: Path, manifest_path: str,
                 new: dict[str, RevisionFacts] | None = None) -> History:
    """Read from the hub: the revisions above the newest one the ledger knew (all of them
    when it knew none; a revision's ancestors never change), the facts of those it does not
    know (`new`: given), and the objects the hub holds."""
    order, stored, _held = _read(store, pod_dir)
    walked = store.revisions_until(set(order))
    revisions = walked
    if walked and walked[-1] in order:           # the rest of the chain: the ledger's
        revisions = walked[:-1] + order[order.index(walked[-1]):]
    facts: dict[str, RevisionFacts] = {**(new or {})}
    for rev in revisions:
        if rev in stored and rev not in facts:
            try:
                facts[rev] = RevisionFacts.from_json(stored[rev])
            except (KeyError, TypeError, ValueError):
                pass                 # a damaged entry is read again from the hub
    facts.update({rev: revision_facts(store, rev, manifest_path) for rev in revisions
                  if rev not in facts})
    named = {sha for rev in revisions for sha in facts[rev].named()}
    on_hub = {sha: size for sha, size in store.stored_objects().items() if sha in named}
    return History(revisions, {rev: facts[rev] for rev in revisions}, on_hub, listed=True)


def record(store, pod_dir: Path, history: History, held: dict[str, int] | None) -> None:
    """Write the ledger: the history's revisions and facts (only those the hub still lists:
    the ledger stays the size of the history) and `held`, what the hub holds now (None: not
    known, a deletion failed; the next step reads the hub)."""
    doc = {"hub": store.url, "order": history.revisions,
           "revisions": {rev: history.facts[rev].to_json() for rev in history.revisions}}
    if held is not None:
        doc["held"] = held
    _write_ledger(pod_dir, doc)
