"""A real tiny pod trained 3 steps by the real worker (tests/conftest.py's
worker_trained_pod, once per session), copied per test; and edits of its manifest entry and
checkpoint that keep the two consistent (the manifest names the new bytes), for tests of
which checkpoints a launch or a merge trusts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launcher.files import sha256_file
from tests.support.pod_files import MANIFEST
from tests.support.pods import copy_pod

CKPT = "checkpoints/fractus_1b_gpu0.pt"


@pytest.fixture
def pod(worker_trained_pod, tmp_path) -> Path:
    return copy_pod(worker_trained_pod, tmp_path / "pod")


def manifest_of(pod: Path) -> dict:
    return json.loads((pod / MANIFEST).read_text())


def set_entry(pod: Path, **fields) -> None:
    data = manifest_of(pod)
    data["gpu_0"].update(fields)
    (pod / MANIFEST).write_text(json.dumps(data))


def rewrite_checkpoint(pod: Path, edit) -> None:
    """Save an edited copy of GPU 0's checkpoint in its place; the manifest names the new
    bytes (so this is the file the manifest means, not a damaged one)."""
    ck = torch.load(pod / CKPT, map_location="cpu", weights_only=True)
    edit(ck)
    torch.save(ck, pod / CKPT)
    set_entry(pod, checkpoint_sha256=sha256_file(pod / CKPT))
