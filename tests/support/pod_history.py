"""Pod files written as the launcher and worker write them, without running either:
checkpoints with their events, a checkpoint history, a supervisor ready to start."""

from __future__ import annotations

import json
import os
from pathlib import Path

from launcher.pod.setup_init import init_pod
from launcher.pod.ckpt_index import PASSED, CheckpointIndex
from launcher.files import sha256_file
from launcher.pod.events import EventLog


def fake_checkpoint(pod, gpu, payload: bytes, next_token: int, step: int) -> dict:
    """Write a file as the worker would (canonical path, atomic) and return its event."""
    path = pod / "checkpoints" / f"fractus_1b_gpu{gpu}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, path)
    return {"event": "checkpoint", "path": str(path), "sha256": sha256_file(path),
            "bytes": len(payload), "next_token": next_token, "step": step, "ema_tf": 5.0,
            "lb": 2.0}


def pod_with_history(tmp_path: Path) -> Path:
    """A tiny-cpu pod whose GPU 0 has a passed checkpoint (token 640) and a newer one not yet
    judged (token 1280, in the manifest) at stage 3; GPU 1 has a manifest entry only."""
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    index = CheckpointIndex(pod)
    good = fake_checkpoint(pod, 0, b"good", 640, 10)
    index.add(0, good, 3, "checkpoints/fractus_1b_gpu0.pt")
    index.mark(0, good["sha256"], PASSED, "ok")
    later = fake_checkpoint(pod, 0, b"later", 1280, 20)
    index.add(0, later, 3, "checkpoints/fractus_1b_gpu0.pt")
    manifest = {"gpu_0": {"start_token": 1280, "checkpoint": "checkpoints/fractus_1b_gpu0.pt",
                          "checkpoint_sha256": later["sha256"], "stage": 3, "ema_tf": 5.0},
                "gpu_1": {"start_token": 960, "stage": 3, "checkpoint": "checkpoints/x1.pt"}}
    (pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json").write_text(json.dumps(manifest))
    return pod


def supervisor_for(pod: Path, stage: int):
    """The real Supervisor of a 2-CPU pod at `stage`, not started."""
    from launcher.supervise.plan import load_plan
    from launcher.supervise.supervisor import Supervisor
    from launcher.supervise.custodian import CheckpointCustodian
    plan, manifest = load_plan(pod, stage, "cpu:2", None)
    log = EventLog(pod)
    return Supervisor(plan, manifest, CheckpointCustodian.for_plan(plan, manifest, log), log)
