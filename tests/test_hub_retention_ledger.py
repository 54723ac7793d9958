"""The retention step decided from the ledger (logs/hub_ledger.json): a push the ledger knows
lists nothing and deletes with one call; a damaged ledger, or another writer's commit, makes
the step read the hub again, keeping what a kept revision names."""

from __future__ import annotations

import json

import pytest

from launcher.config.podconfig import load_pod_config
from launcher.hub import open_store
from launcher.hub.retention_ledger import read_ledger
from launcher.pod.events import read_events
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)
from tests.support.retention_pod import (  # noqa: F401  (hub_url: a pytest fixture)
    GPUS, REPO_ID, assert_holds_the_newest, checkpoint_objects, hub_url, make_pod,
    new_checkpoints, pod_with_pushes, push)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def test_a_push_reads_only_the_revisions_the_ledger_does_not_know(
        tmp_path, capsys, monkeypatch):
    """The retention step is incremental: after many pushes, one more reads the commit
    records it added (one), not the whole history; what it keeps and deletes is unchanged."""
    from launcher.hub.local import FileStore
    pod = make_pod(tmp_path, f"file://{tmp_path / 'store'}", {"keep": 2})
    for n in range(6):
        new_checkpoints(pod, 1000 * (n + 1))
        push(pod, capsys)
    read: list[str] = []
    real_record = FileStore._record

    def counting_record(self, rev):
        read.append(rev)
        return real_record(self, rev)
    new_checkpoints(pod, 7000)
    store = open_store(f"file://{tmp_path / 'store'}", pod)
    before = store.head()
    monkeypatch.setattr(FileStore, "_record", counting_record)
    head = push(pod, capsys)
    monkeypatch.setattr(FileStore, "_record", real_record)
    # The push reads the head it builds on; retention reads the new head's record only
    # (before: all 7 records, the whole history, at every push).
    assert set(read) <= {before, head}, f"{len(set(read))} revisions read"
    history = [h.revision for h in store.history()]
    assert history[0] == head and len(history) == 7
    kept = {sha for rev in history[:2] for sha in checkpoint_objects(store, rev)}
    named = {sha for rev in history for sha in checkpoint_objects(store, rev)}
    assert {sha for sha in store.stored_objects() if sha in named} == kept


@pytest.mark.parametrize("damage", ["emptied", "torn"])
def test_a_ledger_a_crash_emptied_or_tore_is_read_again_from_the_hub(tmp_path, capsys, damage):
    """The ledger is rewritten in place without fsync (a cache): emptied, or torn (its
    bytes no longer match its checksum line, though still JSON), the next push reads the
    history from the hub again and keeps and deletes exactly what it would have."""
    hub_url = f"file://{tmp_path / 'store'}"
    pod, store, _revisions = pod_with_pushes(tmp_path, hub_url, capsys, {"keep": 2}, 4)
    path = pod / "logs" / "hub_ledger.json"
    if damage == "emptied":
        path.write_bytes(b"")
    else:
        checksum, body = path.read_bytes().split(b"\n", 1)
        held = json.loads(body)["held"]
        json.loads(body.replace(next(iter(held)).encode(), b"0" * 64))   # still JSON
        path.write_bytes(checksum + b"\n" + body.replace(next(iter(held)).encode(), b"0" * 64))
    assert read_ledger(pod) == {}
    new_checkpoints(pod, 5000)
    push(pod, capsys)
    assert_holds_the_newest(store, 2)
    (event,) = [e for e in read_events(pod) if e.get("event") == "hub_retention"][-1:]
    assert event["listed"] is True
    ledger = read_ledger(pod)
    history = [h.revision for h in store.history()]
    assert ledger["order"] == history and set(ledger["revisions"]) == set(history)




def test_a_push_the_ledger_knows_deletes_with_one_call_and_lists_nothing(
        tmp_path, capsys, request, monkeypatch):
    """After a push built on the newest revision the ledger knew, the step decides from the
    ledger: no listing of commits or LFS files, one deletion call (none when nothing fell
    out); a deletion that fails leaves what the hub holds unknown, so the next push lists."""
    hub = request.getfixturevalue("test_hub")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    hub_url = f"hf://{REPO_ID}"
    pod = make_pod(tmp_path, hub_url, {"keep": 2})
    store = open_store(hub_url, pod)

    def push_counting() -> dict[str, int]:
        before = {route: len(hub.routed(route)) for route in
                  ("commits", "lfs_files", "lfs_delete")}
        push(pod, capsys)
        return {route: len(hub.routed(route)) - n for route, n in before.items()}

    new_checkpoints(pod, 1000)
    first = push_counting()                       # no ledger yet: the hub is read
    assert first["commits"] == 1 and first["lfs_files"] == 1 and first["lfs_delete"] == 0
    new_checkpoints(pod, 2000)
    assert push_counting() == {"commits": 0, "lfs_files": 0, "lfs_delete": 0}   # nothing fell out
    new_checkpoints(pod, 3000)
    assert push_counting() == {"commits": 0, "lfs_files": 0, "lfs_delete": 1}
    (event,) = [e for e in read_events(pod) if e.get("event") == "hub_retention"][-1:]
    assert event["deleted_objects"] == GPUS and event["listed"] is False

    hub.faults.add("lfs_delete", "status", status=403)
    new_checkpoints(pod, 4000)
    assert push_counting()["lfs_delete"] == 1
    failed = [e for e in read_events(pod) if e.get("event") == "hub_retention_failed"]
    assert len(failed) == 1 and failed[0]["retry"] == "after the next push"
    new_checkpoints(pod, 5000)
    after_failure = push_counting()
    assert after_failure["lfs_files"] == 1 and after_failure["lfs_delete"] == 1
    assert_holds_the_newest(store, 2)


def test_a_revision_another_writer_committed_makes_the_step_read_the_hub(tmp_path, capsys):
    """Another writer's commit (a node, another pod) between two of this pod's pushes: the
    ledger does not know it, so the step reads the hub and keeps what that commit names.
    Here it names the checkpoints of an older push, which the ledger alone would delete."""
    hub_url = f"file://{tmp_path / 'store'}"
    pod, store, revisions = pod_with_pushes(tmp_path, hub_url, capsys, {"keep": 2}, 3)
    second = checkpoint_objects(store, revisions[1])
    # The other writer pushes the second push's checkpoints again, as the head.
    other = open_store(hub_url, tmp_path / "other")
    config = load_pod_config(pod)
    other.pull([config.checkpoint_path(gpu) for gpu in range(GPUS)], revisions[1])
    other.push([config.checkpoint_path(gpu) for gpu in range(GPUS)], "another writer")
    new_checkpoints(pod, 4000)
    head = push(pod, capsys)
    # The newest 2 pushes: this one and the other writer's, which names `second`.
    held = set(store.stored_objects())
    assert set(second) <= held
    assert set(checkpoint_objects(store, head)) <= held
    assert not set(checkpoint_objects(store, revisions[2])) & held
    (event,) = [e for e in read_events(pod) if e.get("event") == "hub_retention"][-1:]
    assert event["listed"] is True

