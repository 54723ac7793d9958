"""Commands a person runs against a pod: rollback by hand, and what `sync push` sends."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from launcher.ckpt_index import FAILED, CheckpointIndex
from launcher.errors import UserError
from launcher.events import EventLog
from launcher.lock import PodLock, read_holder
from launcher.manifest import apply_rollback, read_manifest, write_manifest
from launcher.podconfig import load_config
from launcher.stages import get_stage, load_stages
from launcher.state import write_rollback_request


def manual_rollback(pod_dir: Path, to_stage: int, gpus: list[int]) -> str:
    """Restore `gpus` to their newest passed checkpoints and set the pod to `to_stage`.

    With a launcher running, it is asked to do it (same code path as an automatic
    rollback, then it relaunches at `to_stage`); otherwise the manifest is changed here,
    under the pod lock, and the next `launch` resumes from it."""
    config = load_config(pod_dir)
    get_stage(load_stages(pod_dir / config.stages), to_stage)
    holder = read_holder(pod_dir)
    if holder is not None:
        write_rollback_request(pod_dir, to_stage, gpus)
        return (f"asked the running launcher (pid {holder.get('pid')}) to roll back to stage "
                f"{to_stage}" + (f" restoring GPU(s) {gpus}" if gpus else ""))
    with PodLock(pod_dir):
        manifest = read_manifest(pod_dir / config.manifest)
        index = CheckpointIndex(pod_dir)
        events = EventLog(pod_dir)
        targets = {}
        for gpu in gpus:
            if gpu not in manifest.entries:
                raise UserError(f"GPU {gpu} has no manifest entry to roll back")
            target = index.newest_passed(gpu)
            if target is None:
                raise UserError(f"GPU {gpu} has no passed checkpoint to restore")
            targets[gpu] = target
        lines = []
        for gpu, target in targets.items():
            for record in index.for_gpu(gpu):
                if record["next_token"] > target["next_token"] and record["verdict"] != FAILED:
                    index.mark(gpu, record["sha256"], FAILED, "rolled back by hand")
            events.emit("rollback", gpu=gpu, from_stage=manifest.entries[gpu].get("stage"),
                        to_stage=to_stage, from_token=manifest.start_token(gpu),
                        to_token=target["next_token"], checkpoint=target["path"],
                        reason="by hand", automatic=False)
            apply_rollback(manifest, gpu, target, to_stage)
            lines.append(f"GPU {gpu}: restored token {target['next_token']:,} ({target['path']})")
        for gpu, entry in manifest.entries.items():
            entry["stage"] = to_stage
        if manifest.entries:
            write_manifest(manifest)
        events.emit("stage_change", to_stage=to_stage, reason="rollback by hand")
    lines.append(f"pod set to stage {to_stage}; resume with `fractus-pod launch --stage {to_stage}`")
    return "\n".join(lines)


def passed_push_files(pod_dir: Path) -> tuple[dict[str, Path], dict[int, str]]:
    """Every GPU's newest passed checkpoint plus a manifest naming exactly those files.

    A checkpoint whose verdict is pending or failed is never sent; the manifest sent is
    written for this push so the hub never shows a manifest pointing at other files.
    Returns (pod-relative path -> local file, gpu -> sha256 pushed)."""
    config = load_config(pod_dir)
    manifest = read_manifest(pod_dir / config.manifest)
    index = CheckpointIndex(pod_dir)
    files: dict[str, Path] = {}
    pushed = {}
    for gpu, entry in sorted(manifest.entries.items()):
        target = index.newest_passed(gpu)
        if target is None:
            continue
        rel = config.checkpoint_path(gpu)
        files[rel] = pod_dir / target["path"]
        pushed[f"gpu_{gpu}"] = {**entry, "start_token": target["next_token"], "checkpoint": rel,
                                "checkpoint_sha256": target["sha256"],
                                "ema_tf": target.get("ema_tf"), "lb": target.get("lb")}
    if not files:
        raise UserError("no checkpoint has passed its checks yet: nothing to push")
    out = dict(manifest.extra)
    out.update(pushed)
    tmp = Path(tempfile.mkdtemp(prefix="fractus-push-")) / Path(config.manifest).name
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    files[config.manifest] = tmp
    shas = {int(key[4:]): entry["checkpoint_sha256"] for key, entry in pushed.items()}
    return files, shas


def record_hub_revision(pod_dir: Path, shas: dict[int, str], revision: str) -> str:
    """Note in the local manifest which hub revision holds each GPU's current checkpoint
    (only where the manifest still names the pushed bytes). A running launcher owns the
    manifest, so then nothing is written here."""
    if read_holder(pod_dir) is not None:
        return "a launcher is running: the manifest's hub_revision is left to it"
    config = load_config(pod_dir)
    with PodLock(pod_dir):
        manifest = read_manifest(pod_dir / config.manifest)
        noted = [gpu for gpu, sha in shas.items()
                 if manifest.entries.get(gpu, {}).get("checkpoint_sha256") == sha]
        for gpu in noted:
            manifest.entries[gpu]["hub_revision"] = revision
        if noted:
            write_manifest(manifest)
    return f"manifest: hub_revision {revision[:12]} recorded for GPU(s) {noted}"
