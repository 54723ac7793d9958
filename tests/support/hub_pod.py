"""A tiny CPU pod for hub tests, with checkpoints written as the worker writes them (replaced
atomically) and their events recorded in the index and manifest, as the launcher does."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from launcher.config.podconfig import load_pod_config
from launcher.pod.ckpt_index import PASSED, CheckpointIndex
from launcher.files import sha256_file
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest
from tests.support.e2e import TEST_CRITERIA
from tests.support.pod_files import MANIFEST  # noqa: F401 (re-exported for hub tests)

# Only per-line checks (no periodic ones): every clean metrics line vouches for the steps
# before it, so a checkpoint passes as soon as its step is logged, the final one included.
FAST_PASS = copy.deepcopy(TEST_CRITERIA)
for _name in ("trend", "lb_band", "ss_ratio"):
    FAST_PASS["checks"][_name]["interval"] = 0
CKPT = "checkpoints/fractus_1b_gpu{}.pt"


@pytest.fixture
def pod(tmp_path) -> Path:
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    return pod


def write_checkpoint(pod: Path, index: CheckpointIndex, manifest, gpu: int, token: int,
                     verdict: str, stage: int = 1) -> dict:
    """A checkpoint file as the worker writes it (replaced atomically) and its event, trained
    at `stage`."""
    path = pod / CKPT.format(gpu)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(os.urandom(4096) + f"gpu{gpu}@{token}".encode())
    os.replace(tmp, path)
    event = {"path": str(path), "sha256": sha256_file(path), "next_token": token,
             "step": token // 32, "ema_tf": 5.0, "lb": 1.0, "bytes": path.stat().st_size}
    index.add(gpu, event, stage, CKPT.format(gpu))
    if verdict != "pending":
        index.mark(gpu, event["sha256"], verdict, "test")
    apply_checkpoint(manifest, gpu, event, stage, pod, f"data/shard_phase2_gpu{gpu}.npy")
    return event


def add_passed(pod: Path, gpu: int, token: int) -> dict:
    """A new passed checkpoint of `gpu` at `token`, recorded in the index and manifest."""
    config = load_pod_config(pod)
    manifest = read_manifest(pod / config.manifest)
    event = write_checkpoint(pod, CheckpointIndex(pod), manifest, gpu, token, PASSED)
    write_manifest(manifest)
    return event


def run(capsys, pod: Path, *args: str) -> tuple[int, str, str]:
    """The CLI in-process: its exit code, stdout and stderr."""
    capsys.readouterr()
    code = cli_main(["--pod-dir", str(pod), *args])
    out = capsys.readouterr()
    return code, out.out, out.err
