"""Retention's refusals: a push over the budget, a budget smaller than one push (at the first
push, and at launch when the checkpoints give its size), a bad `retention:`: one line, an
event where it applies, nothing written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from launcher.config.podconfig import load_pod_config
from launcher.files import sha256_file
from launcher.hub import open_store
from launcher.hub.sync import HubSync, RunLease
from launcher.hub.sync_state import read_sync_state
from launcher.pod.ckpt_index import PASSED, CheckpointIndex
from launcher.pod.events import EventLog, read_events
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest
from tests.support.retention_pod import CKPT_BYTES, GPUS, make_pod, new_checkpoints, push

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def test_a_push_over_the_budget_is_refused_in_one_line_and_an_event(tmp_path, capsys):
    hub_url = f"file://{tmp_path / 'store'}"
    one_push = GPUS * CKPT_BYTES
    # keep 3 needs 4 pushes' room at the peak (the new one lands before the oldest goes).
    pod = make_pod(tmp_path, hub_url, {"keep": 3, "budget": int(3.5 * one_push)})
    store = open_store(hub_url, pod)
    for n in range(3):
        new_checkpoints(pod, 1000 * (n + 1))
        push(pod, capsys)
    before = store.head()
    new_checkpoints(pod, 4000)
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "retention.budget" in err[0] and "push refused" in err[0], err
    assert store.head() == before
    refused = [e for e in read_events(pod) if e.get("event") == "hub_budget_refused"]
    assert len(refused) == 1 and refused[0]["reason"] == "by hand"

    # The launcher's push: refused the same way, recorded, and never raised into the loop.
    config = load_pod_config(pod)
    manifest = read_manifest(pod / config.manifest)
    log = EventLog(pod)
    sync = HubSync(pod, config, manifest, CheckpointIndex(pod), log, RunLease(pod, log))
    sync.finish()
    assert store.head() == before
    state = read_sync_state(pod)
    assert state["last_result"] == "budget_refused" and "push refused" in state["last_error"]
    refused = [e for e in read_events(pod) if e.get("event") == "hub_budget_refused"]
    assert [e["reason"] for e in refused] == ["by hand", "stop"]


def pod_past_a_1mib_budget(tmp_path: Path) -> Path:
    """A pod whose checkpoints make one push larger than its retention.budget (1 MiB)."""
    pod = make_pod(tmp_path, f"file://{tmp_path / 'store'}", {"keep": 2, "budget": "1MiB"})
    new_checkpoints(pod, 1000)
    big = load_pod_config(pod).checkpoint_path(0)
    # Four 64 KiB checkpoints fit in 1 MiB: grow one GPU's past it.
    (pod / big).write_bytes(os.urandom(2 << 20))
    index = CheckpointIndex(pod)
    event = {"path": str(pod / big), "sha256": sha256_file(pod / big), "next_token": 2000,
             "step": 60, "ema_tf": 5.0, "lb": 1.0, "bytes": 2 << 20}
    index.add(0, event, 1, big)
    index.mark(0, event["sha256"], PASSED, "test")
    manifest = read_manifest(pod / load_pod_config(pod).manifest)
    apply_checkpoint(manifest, 0, event, 1, pod, load_pod_config(pod).shard_path(0))
    write_manifest(manifest)
    return pod


def tree(pod: Path) -> list:
    """Every path under the pod, a file with its bytes: compared before and after."""
    return sorted((p, p.read_bytes() if p.is_file() else None) for p in pod.rglob("*"))


def test_a_budget_smaller_than_one_push_says_so_at_the_first_push(tmp_path, capsys):
    pod = pod_past_a_1mib_budget(tmp_path)
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "smaller than one push" in err[0] and "first push" in err[0], err
    assert not (tmp_path / "store" / "refs").exists()


def test_a_launch_refuses_a_budget_smaller_than_the_push_its_checkpoints_make(tmp_path,
                                                                               capsys):
    """Known at launch when the manifest names checkpoints: exit 2, one line naming the
    budget, the push's size and the budget that fits, and nothing written (before, the pod
    launched and every push was refused for the rest of the run)."""
    pod = pod_past_a_1mib_budget(tmp_path)
    before = tree(pod)
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "launch", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: retention.budget 1.05 MB is smaller "
                                               "than one push (2.29 MB, the 4 checkpoint(s) "
                                               "the manifest names): raise retention.budget "
                                               "to at least 6.88 MB"), err
    assert tree(pod) == before


@pytest.mark.parametrize("retention, words", [
    ({"keep": 0}, "retention.keep must be an integer from 1"),
    ({"keep": "3"}, "retention.keep must be an integer"),
    ({"keep": 3, "budget": "lots"}, "retention.budget must be a size"),
    ({"keep": 3, "budget": 10}, "retention.budget must be a size"),
    ({"keep": 3, "pins": ["main"]}, "retention.pins must be a list of revision ids"),
    ({"keep": 3, "milestones": "yes"}, "retention.milestones must be true or false"),
    ({"keep": 3, "forever": True}, "forever"),
])
def test_a_bad_retention_is_one_line_and_writes_nothing(tmp_path, capsys, retention, words):
    pod = make_pod(tmp_path, f"file://{tmp_path / 'store'}", retention)
    before = tree(pod)
    for command in (["sync", "push"], ["launch", "--max-steps", "1"]):
        assert cli_main(["--pod-dir", str(pod), *command]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and err[0].startswith("error: "), err
        assert tree(pod) == before


