"""CUDA devices checked before anything starts (issue 16 item 5, issue 20).

`devices: cuda:0-7` on a machine without those GPUs is refused by `launch` with one line,
exit 2, before the pod lock, the manifest or any worker (it used to start 8 workers that
failed 38 s later with the cause only in a worker log). nvidia-smi absent or failing is a
witness missing, never a traceback: the count then comes from the workers' torch.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from launcher.config import gpus
from launcher.config.devices import parse_devices

REPO = Path(__file__).resolve().parents[1]
DRIVER_DOWN = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() >= 8, reason="this machine has 8 GPUs")


def fractus_pod(pod: Path, *args: str, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def snapshot(pod: Path) -> dict:
    return {str(p.relative_to(pod)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(pod.rglob("*")) if p.is_file()}


def failing_nvidia_smi(tmp_path: Path) -> dict:
    """PATH with an nvidia-smi that fails as it does when the driver is not loaded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{DRIVER_DOWN}\nEOF\nexit 9\n")
    tool.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.fixture
def pod_8gpu(tmp_path) -> Path:
    """`init --preset 1b-8gpu` with its 8 shards in place: everything but the GPUs."""
    pod = tmp_path / "pod"
    assert fractus_pod(pod, "init", "--preset", "1b-8gpu").returncode == 0
    for i in range(8):
        np.save(pod / "data" / f"shard_phase2_gpu{i}.npy", np.arange(20_000, dtype=np.int32))
    return pod


@pytest.mark.parametrize("smi", ["absent", "failing"])
def test_launch_on_gpus_the_machine_lacks_refuses_before_anything(pod_8gpu, tmp_path, smi):
    env = failing_nvidia_smi(tmp_path) if smi == "failing" else dict(
        os.environ, PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                         if not (Path(p) / "nvidia-smi").exists()))
    before = snapshot(pod_8gpu)

    done = fractus_pod(pod_8gpu, "launch", env=env)

    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()          # one line, no traceback
    assert line.startswith("error: devices 'cuda:0-7' asks for GPU(s) 0-7 but this machine "
                           "has no GPU ")
    assert "torch sees" in line and "cpu:N" in line
    assert ("nvidia-smi not found" if smi == "absent" else
            f"nvidia-smi failed (exit 9): {DRIVER_DOWN[:100]}") in line
    assert snapshot(pod_8gpu) == before                  # no lock, no log, no worker
    assert not list((pod_8gpu / "logs").glob("worker_gpu*.log"))


def test_a_failing_nvidia_smi_falls_back_to_torch_for_auto(tmp_path, monkeypatch):
    env = failing_nvidia_smi(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    gpus.nvidia_smi.cache_clear()
    gpus.torch_cuda_count.cache_clear()
    try:
        report = gpus.nvidia_smi()
        assert report.count is None and report.problem.startswith("nvidia-smi failed (exit 9)")
        have = torch.cuda.device_count()
        assert gpus.visible_gpu_count() == have
        slots = parse_devices("auto")
        assert [s.device for s in slots] == (["cuda"] * have or ["cpu", "cpu"])
    finally:
        gpus.nvidia_smi.cache_clear()
        gpus.torch_cuda_count.cache_clear()


REFUSING_WORKER = ["python", "-c", "import sys; print('error: DEVICE is cuda but CUDA is not "
                   "available', file=sys.stderr); sys.exit(2)"]


def test_status_shows_the_last_worker_error_of_a_worker_that_wrote_no_event(tmp_path):
    """A worker refusing its settings writes its one line to stderr (its log), no event:
    the launcher's reason and status's `last_error` carry that line (it was null)."""
    import json

    from tests.support.e2e import make_pod
    pod = make_pod(tmp_path, worker=REFUSING_WORKER)

    done = fractus_pod(pod, "launch", "--stage", "1", "--gpus", "0")

    assert done.returncode == 2, done.stdout + done.stderr
    cause = "error: DEVICE is cuda but CUDA is not available"
    assert f"refused its settings or files (exit 2: {cause})" in done.stdout
    report = json.loads(fractus_pod(pod, "status", "--json").stdout)
    (gpu0,) = [row for row in report["gpus"] if row["gpu"] == 0]
    assert gpu0["last_error"] == cause
