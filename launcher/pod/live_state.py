"""Files the launcher shares with the other commands: logs/pod_state.json (written by the
running launcher, read by `status`) and logs/rollback_request.json (written by
`fractus-pod rollback` while a launcher runs, consumed by it)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from launcher.paths import STATE_FILE, REQUEST_FILE  # noqa: F401 (re-exported)
from launcher.files import atomic_write_text, read_json_state, write_json_state



def pod_state_dict(sup) -> dict:
    gpus = {}
    for gpu, run in sup.runs.items():
        verdict = run.health.verdict() if run.health else None
        gpus[str(gpu)] = {
            "pid": run.proc.pid if run.proc is not None else None,
            "device": run.slot.device,
            "node": run.node,
            "state": run.state,
            "exit_code": run.exit_code,
            "restarts": len(run.restarts),
            "verdict": verdict.phase if verdict else None,
            "reason": verdict.reason if verdict else None,
            "checks": verdict.checks if verdict else {},
            "last_error": run.last_error,
        }
    return {"launcher_pid": os.getpid(), "pod_state": sup.pod_state, "stage": sup.stage,
            "stage_name": sup.plan.stages[sup.stage].name, "reason": sup.reason,
            "started_at": sup.started_at, "updated_at": time.time(),
            "rolled_back": sup.rolled_back, "gpus": gpus}


def write_pod_state(sup) -> None:
    # No indent: the C encoder (this file is rewritten every few seconds; status pretty-prints).
    write_json_state(sup.pod_dir / STATE_FILE, pod_state_dict(sup))


def read_pod_state(pod_dir: Path) -> dict | None:
    return read_json_state(pod_dir / STATE_FILE) or None


def write_rollback_request(pod_dir: Path, to_stage: int, gpus: list[int]) -> Path:
    path = pod_dir / REQUEST_FILE
    atomic_write_text(path, json.dumps({"to_stage": to_stage, "gpus": gpus,
                                        "ts": time.time()}) + "\n")
    return path


def take_rollback_request(pod_dir: Path) -> dict | None:
    path = pod_dir / REQUEST_FILE
    try:
        request = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        request = None
    path.unlink(missing_ok=True)
    return request if isinstance(request, dict) and "to_stage" in request else None
