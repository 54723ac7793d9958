"""The retention ledger `logs/hub_ledger.json`: what the hub's revisions name (fixed once
committed), in order, and the checkpoint objects the hub held after the last retention step
(`held`, written only when the deletion completed). A cache of the hub, written only through
launcher/hub/retention.py (after a push, and by `sync history`); the hub stays the truth.

Rewritten in place, no fsync, no temp file: replacing it frees the old file, and on a disk
mounted with `discard` that unlink alone cost ~0.45 ms, more than the rest of the step (an
in-place write ~4 us). Its first line is the sha256 of the rest: a torn write reads as no
ledger, and the hub is read again. A push whose parent is the ledger's newest revision,
with `held` recorded, decides from the ledger alone; anything else reads the hub."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from launcher.paths import HUB_LEDGER, MERGED_PATH, RECOVERY_HUB_DIR
from launcher.pod.manifest import ManifestError, read_manifest

from .round_files import MAX_ROUND, index_round

CHECKPOINT_SUFFIXES = (".pt", ".safetensors", ".bin")


@dataclass(frozen=True)
class RevisionFacts:
    objects: dict[str, int]         # sha256 -> size of each checkpoint file it names
    stages: tuple[int, ...]         # the distinct stages its manifest's GPUs record
    merged: str | None              # sha256 of the merged brain it names, if any
    phases: tuple[int, ...] = ()    # the distinct data phases its manifest's GPUs are in
    # sha256 -> size of each recovery copy it names (not in `objects`: no push of its own)
    recovery: dict[str, int] = field(default_factory=dict)
    round: int = 0                  # the newest merge round whose merged file it holds

    def to_json(self) -> dict:
        return {"objects": self.objects, "stages": list(self.stages), "merged": self.merged,
                "phases": list(self.phases), "recovery": self.recovery, "round": self.round}

    def named(self) -> set[str]:
        """Every object it names that retention may delete: checkpoints, recovery copies."""
        return {*self.objects, *self.recovery}

    @classmethod
    def from_json(cls, doc: dict) -> "RevisionFacts":
        """KeyError on a missing key: the caller reads the revision from the hub again."""
        objects = {str(k): int(v) for k, v in dict(doc["objects"]).items()}
        recovery = {str(k): int(v) for k, v in dict(doc.get("recovery") or {}).items()}
        round_n = int(doc.get("round") or 0)
        if not 0 <= round_n <= MAX_ROUND:
            raise ValueError(f"round {round_n} out of range")
        return cls(objects, tuple(int(s) for s in doc["stages"]), doc.get("merged"),
                   tuple(int(p) for p in doc["phases"]), recovery, round_n)


@dataclass
class History:
    """Revisions newest first; `stored`: held objects some revision names (sha256 -> size)."""
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
                         else None, phases, recovery, index_round(index))


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
    """Facts of a revision this pod just pushed, nothing read back from the hub."""
    return _facts(store.files_at(revision), tuple(manifest.recorded_stages()),
                  tuple(manifest.recorded_phases()))


def read_ledger(pod_dir: Path) -> dict:
    """The ledger; {} when missing, torn (checksum mismatch) or not a mapping."""
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
    """The history after this pod pushed `revision`: the ledger alone if it knew the parent."""
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
    """From the hub: revisions above the ledger's newest known one, facts the ledger lacks
    (`new`: given) and the objects held."""
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
    """Write the ledger (only revisions the hub still lists); `held` None: unknown after a
    failed deletion, so the next step reads the hub."""
    doc = {"hub": store.url, "order": history.revisions,
           "revisions": {rev: history.facts[rev].to_json() for rev in history.revisions}}
    if held is not None:
        doc["held"] = held
    _write_ledger(pod_dir, doc)
