"""A GPU never resumes from a checkpoint marked failed (logs/checkpoints.jsonl): when the
pod fails, and before every launch, such an entry moves to the GPU's newest passed checkpoint,
or back to token 0 with its own files set aside (renamed, never deleted). docs/LAUNCHER.md,
Checkpoint verdicts.
"""

from __future__ import annotations

import os
from pathlib import Path

from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex, rotated_names
from launcher.files import sha256_file
from launcher.errors import UserError
from launcher.pod.events import EventLog
from launcher.pod.manifest import Manifest, apply_rollback, event_position


def failed_record(manifest: Manifest, index: CheckpointIndex, gpu: int) -> dict | None:
    """The failed record of the checkpoint `gpu`'s entry names, else None (an entry without
    a sha256 is hashed only when a failed record matches its path and token)."""
    entry = manifest.entries.get(gpu)
    path = entry.checkpoint if entry else None
    if not path:
        return None
    sha = entry.checkpoint_sha256
    if sha is None:
        suspects = [r for r in index.for_gpu(gpu) if r["verdict"] == FAILED
                    and r["path"] == path and event_position(r) == entry.position]
        file = index.pod_dir / path
        if not suspects or not file.is_file():
            return None
        sha = sha256_file(file)
    record = index.records.get((gpu, sha))
    return record if record is not None and record["verdict"] == FAILED else None


def set_aside(pod_dir: Path, own_file: str) -> list[str]:
    """Rename a GPU's own checkpoint file and rotated copies to `NAME.failed`; the names moved."""
    moved = []
    source = pod_dir / own_file
    for path in [source, *rotated_names(source)]:
        if path.is_file():
            os.replace(path, path.with_name(f"{path.name}.failed"))
            moved.append(str(path.relative_to(pod_dir)))
    return moved


def start_over(pod_dir: Path, manifest: Manifest, gpu: int, own_file: str,
               stage: int | None = None) -> list[str]:
    """Send `gpu` to token 0, no checkpoint (at `stage`), its files set aside; the names moved."""
    moved = set_aside(pod_dir, own_file)
    entry = manifest.entries.get(gpu)
    if entry is not None:
        entry.start_over()
        if stage is not None:
            entry.set_stage(stage)
    return moved


def starts_over(manifest: Manifest, index: CheckpointIndex, gpu: int) -> bool:
    """Whether `gpu` starts over: at token 0 naming no checkpoint, everything it wrote failed.
    A worker must then not resume from its own files, wherever they are."""
    entry = manifest.entries.get(gpu)
    records = index.for_gpu(gpu)
    return (entry is not None and not entry.checkpoint and entry.start_token == 0
            and bool(records) and all(r["verdict"] == FAILED for r in records))


def restore_passed(manifest: Manifest, index: CheckpointIndex, events: EventLog,
                   gpus, refuse: bool, own_file_of) -> bool:
    """Move every entry of `gpus` naming a failed checkpoint to where it may resume; True when
    the manifest changed (the caller writes it). A GPU with nothing to resume from raises
    UserError when `refuse`, else records `manifest_unrestorable`. `own_file_of(gpu)`: its
    own checkpoint file, set aside when it starts over."""
    changed = False
    for gpu in gpus:
        failed = failed_record(manifest, index, gpu)
        if failed is None:
            continue
        entry = manifest.entries[gpu]
        why = f"the manifest named {failed['path']}, marked failed: {failed.get('reason')}"
        target = index.newest_passed(gpu)
        if target is not None:
            events.emit("manifest_restored", gpu=gpu, from_token=entry.start_token,
                        to_token=target["next_token"], checkpoint=target["path"], reason=why)
            apply_rollback(manifest, gpu, target, entry.stage or target.get("stage"))
        elif not any(r["verdict"] == PASSED for r in index.for_gpu(gpu)):
            moved = set_aside(index.pod_dir, own_file_of(gpu))
            events.emit("manifest_restored", gpu=gpu, from_token=entry.start_token,
                        to_token=0, checkpoint=None, set_aside=moved,
                        reason=f"{why}; nothing it wrote passed: it starts over, as it began")
            entry.start_over()
        else:
            line = (f"gpu_{gpu}: {why}; no passed checkpoint of it is left intact on disk "
                    f"(see logs/checkpoints.jsonl): restore one (e.g. `fractus-pod sync pull`) "
                    f"or edit the manifest")
            if refuse:
                raise UserError(line)
            events.emit("manifest_unrestorable", gpu=gpu, reason=line)
            continue
        changed = True
    return changed
