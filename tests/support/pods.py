"""A tiny CPU pod trained for a few steps at stage 1 by the real worker, for launcher tests.

`init --preset tiny-cpu`, one synthetic shard, `steps` steps of stage 1, and the manifest
written from the worker's last checkpoint event, as the launcher does.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

from fractus.data import synth
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest
from launcher.config.devices import Slot
from launcher.config.podconfig import load_pod_config
from launcher.pod.setup_init import init_pod
from launcher.config.stages import load_stages
from launcher.paths import metrics_path
from launcher.supervise.plan import load_plan
from launcher.worker.process import WorkerSpec, build_env, read_records, worker_command


def stage1_pod(pod: Path, steps: int = 3) -> Path:
    init_pod(pod, "tiny-cpu")
    config = load_pod_config(pod)
    synth(pod / "data", shards=1, tokens=20_000, vocab=512, seed=0)
    stages = load_stages(pod / config.stages)
    env = build_env(config, WorkerSpec(Slot(0, "cpu"), stages[1].settings, max_steps=steps))
    subprocess.run(worker_command(config), cwd=pod, env=env, check=True, capture_output=True,
                   timeout=120)
    event = [r for r in read_records(pod / metrics_path(0)) if r.get("event") == "checkpoint"][-1]
    manifest = read_manifest(pod / config.manifest)
    apply_checkpoint(manifest, 0, event, 1, pod, config.shard_path(0))
    write_manifest(manifest)
    return pod


def copy_pod(template: Path, dest: Path) -> Path:
    """A copy of a trained pod (tests/conftest.py's session templates) to change freely."""
    shutil.copytree(template, dest)
    return dest


def launch_plan(pod: Path, stages_path: Path | None = None):
    """(plan, manifest) as `launch` builds them (launcher/supervise/plan.py), with the
    stage table of `stages_path` instead of the pod's when given (a test's variant)."""
    plan, manifest = load_plan(pod, None, None, None)
    if stages_path is not None:
        plan = dataclasses.replace(plan, stages=load_stages(stages_path))
    return plan, manifest
