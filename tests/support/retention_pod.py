"""A pod whose checkpoints are pushed under a `retention:` policy, on file:// and on the test
hub (the real HfApi): the helpers tests/test_hub_retention*.py share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from launcher.cli import main as cli_main
from launcher.config.podconfig import load_pod_config
from launcher.files import sha256_file
from launcher.hub import open_store
from launcher.hub.from_hub import rebuild_from_hub
from launcher.hub.retention_ledger import CHECKPOINT_SUFFIXES
from tests.support.passed_checkpoints import new_checkpoints as passed_checkpoints


GPUS = 4
CKPT_BYTES = 64 << 10
REPO_ID = "fractus/retention"


@pytest.fixture(params=["file", "hf"])
def hub_url(request, tmp_path, monkeypatch):
    """The same policy on both backends: a file:// store, and the test hub (real HfApi)."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    hub = request.getfixturevalue("test_hub")
    hub.lfs_page_size = 3        # the listing pages: the client follows the Link header
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    return f"hf://{REPO_ID}"


def make_pod(tmp_path: Path, hub: str, retention: dict | None) -> Path:
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config.update(hub=hub, retention=retention, devices=f"cpu:{GPUS}")
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    return pod


def new_checkpoints(pod: Path, token: int, stage: int = 1, gpus=range(GPUS),
                    phase: int = 1) -> None:
    passed_checkpoints(pod, token, CKPT_BYTES, gpus, stage, phase)


def push(pod: Path, capsys) -> str:
    """`fractus-pod sync push`: the revision it made."""
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith(("pushed revision", "skipped")))
    assert line.startswith("pushed revision "), line
    return line.split()[-1]


def pod_with_pushes(tmp_path: Path, hub_url: str, capsys, retention: dict,
                    pushes: int) -> tuple[Path, object, list[str]]:
    """A pod under `retention` after `pushes` pushes of new checkpoints: (pod, its store,
    the revisions oldest first)."""
    pod = make_pod(tmp_path, hub_url, retention)
    store = open_store(hub_url, pod)
    revisions = []
    for n in range(pushes):
        new_checkpoints(pod, 1000 * (n + 1))
        revisions.append(push(pod, capsys))
    return pod, store, revisions


def assert_holds_the_newest(store, keep: int) -> None:
    """Of the checkpoint objects some revision names, the store holds exactly the newest
    `keep` revisions' (every revision here is a push)."""
    history = [h.revision for h in store.history()]
    kept = {sha for rev in history[:keep] for sha in checkpoint_objects(store, rev)}
    named = {sha for rev in history for sha in checkpoint_objects(store, rev)}
    assert {sha for sha in store.stored_objects() if sha in named} == kept


def checkpoint_objects(store, revision: str) -> dict[str, int]:
    return {e.sha256: e.size for p, e in store.files(revision).items()
            if p.endswith(CHECKPOINT_SUFFIXES)}


def stored_checkpoint_bytes(store, named: set[str]) -> int:
    """Bytes of checkpoint objects the store holds (what the policy bounds)."""
    return sum(size for sha, size in store.stored_objects().items() if sha in named)


def rebuilds_a_pod(pod: Path, hub_url: str, revision: str) -> None:
    """`revision` rebuilds a pod: every GPU's checkpoint pulled with its recorded bytes."""
    rebuild_from_hub(pod, hub_url, revision)
    manifest = json.loads((pod / load_pod_config(pod).manifest).read_text())
    for gpu in range(GPUS):
        path = pod / manifest[f"gpu_{gpu}"]["checkpoint"]
        assert sha256_file(path) == manifest[f"gpu_{gpu}"]["checkpoint_sha256"]

