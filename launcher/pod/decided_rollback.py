"""A rollback the launcher decided is recorded before it is carried out, so a launcher
killed meanwhile never loses the failed check. Owner: launcher/supervise/rollback.py writes
logs/rollback_decided.json atomically before anything is stopped and removes it once the
manifest records the rollback; a launch that finds it completes the rollback first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from launcher.errors import UserError
from launcher.files import atomic_write_text, read_json_state
from launcher.paths import DECIDED_ROLLBACK_FILE
from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.pod.events import EventLog
from launcher.pod.failed_resume import start_over
from launcher.pod.manifest import Manifest, apply_rollback


def record_decision(pod_dir: Path, gpus: list[int], from_stage: int, to_stage: int,
                    reason: str, automatic: bool) -> None:
    atomic_write_text(pod_dir / DECIDED_ROLLBACK_FILE, json.dumps({
        "gpus": gpus, "from_stage": from_stage, "to_stage": to_stage, "reason": reason,
        "automatic": automatic, "ts": time.time()}) + "\n")


def clear_decision(pod_dir: Path) -> None:
    (pod_dir / DECIDED_ROLLBACK_FILE).unlink(missing_ok=True)


def read_decision(pod_dir: Path) -> dict | None:
    """The decided rollback a dead launcher left, else None; a damaged one is refused."""
    path = pod_dir / DECIDED_ROLLBACK_FILE
    if not path.exists():
        return None
    decision = read_json_state(path)
    ok = (isinstance(decision.get("gpus"), list)
          and all(isinstance(g, int) and not isinstance(g, bool) for g in decision["gpus"])
          and isinstance(decision.get("to_stage"), int) and decision["to_stage"] >= 1)
    if not ok:
        raise UserError(f"{path} is not a rollback decision (gpus, to_stage); it records a "
                        f"rollback a launcher decided and did not finish: finish it by hand "
                        f"(`fractus-pod rollback --to-stage N --gpu I`), then delete the file")
    return decision


def complete_decision(pod_dir: Path, manifest: Manifest, index: CheckpointIndex,
                      events: EventLog, own_file_of) -> int | None:
    """Carry out a decided rollback a dead launcher left; its target stage, None if none.
    The caller writes the manifest, then calls clear_decision."""
    decision = read_decision(pod_dir)
    if decision is None:
        return None
    to_stage, why = decision["to_stage"], decision.get("reason") or "a failed check"
    for gpu in decision["gpus"]:
        moved = None
        for record in index.pending(gpu):
            index.mark(gpu, record["sha256"], FAILED, f"GPU failed at stage "
                       f"{decision.get('from_stage')} before this was verified ({why})")
        entry = manifest.entries.get(gpu)
        target = index.newest_passed(gpu)
        from_token = entry.start_token if entry else 0
        if target is not None:
            apply_rollback(manifest, gpu, target, to_stage)
        elif entry is not None and not any(r["verdict"] == PASSED for r in index.for_gpu(gpu)):
            moved = start_over(pod_dir, manifest, gpu, own_file_of(gpu), to_stage)
        elif entry is not None:
            raise UserError(f"gpu_{gpu}: a rollback decided by the last launcher ({why}) needs "
                            f"its newest passed checkpoint, and none is left intact on disk "
                            f"(see logs/checkpoints.jsonl): restore one, or edit the manifest")
        events.emit("rollback", gpu=gpu, from_stage=decision.get("from_stage"),
                    to_stage=to_stage, from_token=from_token,
                    to_token=target["next_token"] if target else 0,
                    checkpoint=target["path"] if target else None, reason=why,
                    automatic=decision.get("automatic", True), completed_at_launch=True,
                    **({"set_aside": moved} if moved is not None else {}))
    if not decision["gpus"]:
        manifest.set_stage(to_stage)
    events.emit("stage_change", from_stage=decision.get("from_stage"), to_stage=to_stage,
                reason="rollback decided by the last launcher, completed at launch")
    return to_stage
