"""A worker starts only from the exact bytes its manifest entry names: found and verified
here before each launch and restart, or refused. Order: the named path, a local copy
(retained link, rotated `.pt.N`), the entry's hub revision, the GPU's newest passed
checkpoint (a `rollback`), else RecoveryError; docs/LAUNCHER.md "Hub", "Restoring". An
entry without a sha256 (a manifest the launcher never wrote) has nothing to verify."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launcher.pod.ckpt_index import FAILED, CheckpointIndex
from launcher.files import sha256_file
from launcher.errors import UserError
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest, apply_rollback, relative_to_pod, resolve_in_pod
from launcher.pod.progress import progress
from launcher.paths import INDEX_FILE, PASSED_DIR
from launcher.hub import HubError, open_store

MAX_ROTATED = 8


class RecoveryError(UserError):
    """The named bytes are nowhere: not on disk, not on the hub."""


def holds(path: Path, sha256: str, on_bytes=None) -> bool:
    """`on_bytes(n)` after each block hashed (a progress task's advance)."""
    return path.is_file() and sha256_file(path, on_bytes) == sha256


def _local_copies(pod_dir: Path, gpu: int, named: Path, sha256: str,
                  index: CheckpointIndex, canonical: str) -> list[Path]:
    """Files that may hold the bytes (unverified), retained links first (never rotated)."""
    out = index.copies_of(gpu, sha256)
    for base in (named, pod_dir / canonical):
        out += [base.with_name(f"{base.name}.{k}") for k in range(1, MAX_ROTATED + 1)]
    seen, unique = set(), []
    for path in out:
        if path != named and path not in seen and path.is_file():
            seen.add(path)
            unique.append(path)
    return unique


def local_copy(pod_dir: Path, gpu: int, named: Path, sha256: str, index: CheckpointIndex,
               canonical: str) -> Path | None:
    """A verified file other than `named` holding `sha256`, or None. `pod_dir`: the pod's,
    or a Ray node's own directory."""
    return next((copy for copy in _local_copies(pod_dir, gpu, named, sha256, index, canonical)
                 if holds(copy, sha256)), None)


def retained_copy(pod_dir: Path, gpu: int, next_token: int, sha256: str,
                  index: CheckpointIndex, copy: Path) -> str:
    """`copy` as a retained link (itself, or a new link), pod-relative."""
    rel = relative_to_pod(copy, pod_dir)
    if rel.startswith(PASSED_DIR + "/"):
        return rel
    return index.retain_file(gpu, next_token, sha256, copy)


def recover_entry(pod_dir: Path, gpu: int, manifest: Manifest, index: CheckpointIndex,
                  events: EventLog, hub: str | None, canonical: str,
                  named_intact: bool | None = None) -> bool:
    """Make GPU `gpu`'s entry name a file holding its recorded bytes; True when the entry
    changed (the caller writes the manifest). Raises RecoveryError."""
    entry = manifest.entries.get(gpu)
    name, sha256 = (entry.checkpoint, entry.checkpoint_sha256) if entry else (None, None)
    if not name or not sha256:
        return False
    try:
        named = resolve_in_pod(name, pod_dir)
    except ValueError:
        return False        # outside the pod: validation refuses it, nothing is read here
    if named_intact is None:
        named_intact = holds(named, sha256)
    if named_intact:
        return False
    state = "missing" if not named.is_file() else "holds other bytes"
    copy = local_copy(pod_dir, gpu, named, sha256, index, canonical)
    if copy is not None:
        rel = retained_copy(pod_dir, gpu, entry.start_token, sha256, index, copy)
        entry.name_checkpoint(rel)
        events.emit("checkpoint_recovered", gpu=gpu, checkpoint=rel, was=name,
                    reason=f"{name} {state}; the recorded bytes (sha256 "
                           f"{sha256[:12]}) were found at {relative_to_pod(copy, pod_dir)}")
        return True
    revision = entry.hub_revision
    if hub and revision:
        try:
            open_store(hub, pod_dir).pull([name], revision=revision)
        except (HubError, ValueError) as exc:
            raise RecoveryError(f"gpu_{gpu} checkpoint {name} {state} and the hub could not "
                                f"restore it: {exc}") from None
        events.emit("checkpoint_pulled", gpu=gpu, checkpoint=name, revision=revision)
        return False
    gone = (f"gpu_{gpu} checkpoint {name} {state} (the manifest records sha256 "
            f"{sha256[:12]}) and no local copy or hub revision holds those bytes")
    if _back_to_newest_passed(manifest, index, events, gpu, gone):
        return True
    raise RecoveryError(
        gone + (" (the hub cannot restore them: a checkpoint is pushed only once it passed, "
                "at the next push)" if hub else "")
        + f"; no passed checkpoint of it is left intact either (see {INDEX_FILE}): "
          f"restore the file")


def _back_to_newest_passed(manifest: Manifest, index: CheckpointIndex, events: EventLog,
                           gpu: int, gone: str) -> bool:
    """back_to_passed to the GPU's newest intact passed checkpoint; False: none is left."""
    target = index.newest_passed(gpu)
    if target is None:
        return False
    back_to_passed(manifest, index, events, gpu, gone, target)
    return True


def back_to_passed(manifest: Manifest, index: CheckpointIndex, events: EventLog, gpu: int,
                   gone: str, target: dict, settle=lambda: None) -> None:
    """The entry goes to passed checkpoint `target` (an index record) at its stage, said
    first as a `rollback` event; `settle()` (writing the manifest) runs before the lost
    record is marked failed. `gone`: one line, why."""
    entry = manifest.entries[gpu]
    stage = entry.stage or manifest.recorded_stage() or 1
    lost_sha256 = entry.checkpoint_sha256
    events.emit("rollback", gpu=gpu, from_stage=stage, to_stage=stage,
                from_token=entry.start_token, to_token=target["next_token"],
                checkpoint=target["path"], automatic=True, lost=entry.checkpoint,
                reason=f"{gone}: back to its newest passed checkpoint")
    apply_rollback(manifest, gpu, target, stage)
    if target.get("hub_revision"):
        manifest.note_hub_revision(gpu, target["hub_revision"], target["sha256"])
    settle()
    lost = index.records.get((gpu, lost_sha256))
    if lost is not None and lost["verdict"] != FAILED:
        index.mark(gpu, lost["sha256"], FAILED, f"its bytes are gone: {gone}")


def recover_all(pod_dir: Path, gpus: list[int], manifest: Manifest, index: CheckpointIndex,
                events: EventLog, hub: str | None, canonical_of) -> bool:
    """recover_entry for every GPU, hashing in parallel first (hashlib releases the GIL:
    8 checkpoints take about as long as the largest)."""
    named = {}
    for gpu in gpus:
        entry = manifest.entries.get(gpu)
        if entry and entry.checkpoint and entry.checkpoint_sha256:
            try:
                named[gpu] = resolve_in_pod(entry.checkpoint, pod_dir)
            except ValueError:
                continue
    paths = list(named.values())
    size = sum(p.stat().st_size for p in paths if p.is_file())
    with progress(f"hashing {len(paths)} checkpoint(s)", size, "bytes") as task, \
            ThreadPoolExecutor(max_workers=max(1, len(named))) as pool:
        intact = dict(zip(named, pool.map(
            holds, paths, [manifest.entries[g].checkpoint_sha256 for g in named],
            [task.advance] * len(paths))))
    changed = False
    for gpu in named:
        changed |= recover_entry(pod_dir, gpu, manifest, index, events, hub,
                                 canonical_of(gpu), named_intact=intact[gpu])
    return changed
