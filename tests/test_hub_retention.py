"""Bounded hub storage (`retention:`): after N pushes with keep K the store holds exactly the
kept revisions' and milestones' checkpoint objects (bytes counted), on file:// and on the
test hub through the real HfApi (`list_lfs_files`, `permanently_delete_lfs_files`); kept
revisions still rebuild a pod, deleted ones are refused in one line; the budget refuses a
push with one line and an event. Pushes are the real `sync push` / HubSync code on
checkpoint files written as the worker writes them (random bytes: no training needed)."""


from __future__ import annotations

import json
import os

import pytest
import yaml

from launcher.cli import main as cli_main
from launcher.config.podconfig import load_pod_config
from launcher.files import sha256_file
from launcher.hub import open_store
from launcher.hub.sync_state import read_sync_state
from launcher.pod.ckpt_index import CheckpointIndex
from launcher.pod.events import read_events
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)
from tests.support.retention_pod import (  # noqa: F401  (hub_url: a pytest fixture)
    CKPT_BYTES, GPUS, checkpoint_objects, hub_url, make_pod, new_checkpoints, push,
    rebuilds_a_pod)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def test_after_n_pushes_with_keep_k_the_store_holds_exactly_the_kept_objects(
        tmp_path, capsys, hub_url):
    pod = make_pod(tmp_path, hub_url, {"keep": 2})
    store = open_store(hub_url, pod)
    revisions = []
    for n in range(5):
        new_checkpoints(pod, 1000 * (n + 1))
        revisions.append(push(pod, capsys))
        # Never an object the newest manifest names.
        named_now = {e["checkpoint_sha256"] for k, e in
                     json.loads(store.read_bytes(load_pod_config(pod).manifest, revisions[-1])).items()
                     if k.startswith("gpu_")}
        assert len(named_now) == GPUS and named_now <= set(store.stored_objects())
    objects = {rev: checkpoint_objects(store, rev) for rev in revisions}
    named = {sha for o in objects.values() for sha in o}
    kept = {sha: size for rev in revisions[-2:] for sha, size in objects[rev].items()}
    held = {sha: size for sha, size in store.stored_objects().items() if sha in named}
    assert held == kept
    assert sum(held.values()) == 2 * GPUS * CKPT_BYTES
    # What status reads: the storage figures of the last push.
    state = read_sync_state(pod)
    assert state["hub_bytes_per_push"] == GPUS * CKPT_BYTES
    assert state["hub_bytes_kept"] >= 2 * GPUS * CKPT_BYTES
    (event,) = [e for e in read_events(pod) if e.get("event") == "hub_retention"][-1:]
    assert event["deleted_objects"] == GPUS and event["freed_bytes"] == GPUS * CKPT_BYTES
    assert cli_main(["--pod-dir", str(pod), "status", "--wide"]) == 0
    assert "hub storage: " in capsys.readouterr().out

    # `sync history` marks the revisions that can no longer rebuild a pod, and says storage.
    assert cli_main(["--pod-dir", str(pod), "sync", "history"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("hub storage: ") and "per push" in out[0]
    by_rev = {line.split()[0]: line for line in out[1:]}
    for rev in revisions[:3]:
        assert "checkpoints deleted" in by_rev[rev[:12]]
    for rev in revisions[3:]:
        assert "kept: one of the newest 2" in by_rev[rev[:12]]

    # Each kept revision still rebuilds a pod; a deleted one is refused in one line, before
    # anything is pulled (the directory stays empty).
    for rev in revisions[3:]:
        rebuilds_a_pod(tmp_path / f"rebuilt_{rev[:12]}", hub_url, rev)
    refused = tmp_path / "refused"
    code = cli_main(["--pod-dir", str(refused), "launch", "--from-hub",
                     hub_url, "--revision", revisions[1]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "deleted by the hub's retention policy" in err[0] and revisions[1][:12] in err[0]
    assert not refused.exists() or not any(refused.iterdir())


def test_stage_ends_and_pins_are_kept_and_an_unchanged_gpus_checkpoint_survives(
        tmp_path, capsys):
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, {"keep": 1})
    store = open_store(hub_url, pod)
    new_checkpoints(pod, 1000)
    pinned = push(pod, capsys)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["retention"] = {"keep": 1, "pins": [pinned[:9]]}      # a prefix, as people type
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    new_checkpoints(pod, 2000)
    push(pod, capsys)
    new_checkpoints(pod, 3000)
    stage1_end = push(pod, capsys)
    # GPU 3 stops moving: its stage-1 checkpoint is named by every later revision.
    for token in (4000, 5000, 6000):
        new_checkpoints(pod, token, stage=2, gpus=range(GPUS - 1))
        head = push(pod, capsys)

    named = {sha for h in store.history() for sha in checkpoint_objects(store, h.revision)}
    expected = {**checkpoint_objects(store, head), **checkpoint_objects(store, stage1_end),
                **checkpoint_objects(store, pinned)}
    held = {sha: size for sha, size in store.stored_objects().items() if sha in named}
    assert held == expected
    # GPU 3's one checkpoint is in all of them; head + stage end + pin, nothing else.
    assert sum(held.values()) == (3 * GPUS - 1) * CKPT_BYTES
    assert cli_main(["--pod-dir", str(pod), "sync", "history"]) == 0
    out = capsys.readouterr().out
    assert f"{stage1_end[:12]}" in out and "kept: end of stage 1" in out
    assert "kept: pinned" in out
    for rev in (head, stage1_end, pinned):          # each kept revision rebuilds a pod
        rebuilds_a_pod(tmp_path / f"rebuilt_{rev[:12]}", hub_url, rev)


def test_the_last_push_of_a_data_phase_is_kept(tmp_path, capsys):
    """The checkpoints that ended phase 1 are a milestone, as a stage's end: a rollback
    to the end of phase 1 (or a rebuild there) stays possible whatever `keep` says."""
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, {"keep": 1})
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["shards"] = ["data/shard_gpu{i}.pt", "data/shard_phase2_gpu{i}.npy"]
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    store = open_store(hub_url, pod)
    new_checkpoints(pod, 1000)
    push(pod, capsys)
    new_checkpoints(pod, 2000)
    phase1_end = push(pod, capsys)
    for token in (1000, 2000):                   # phase 2 from its token 0, the same stage
        new_checkpoints(pod, token, phase=2)
        head = push(pod, capsys)
    named = {sha for h in store.history() for sha in checkpoint_objects(store, h.revision)}
    held = {sha: size for sha, size in store.stored_objects().items() if sha in named}
    assert held == {**checkpoint_objects(store, head),
                    **checkpoint_objects(store, phase1_end)}
    assert cli_main(["--pod-dir", str(pod), "sync", "history"]) == 0
    by_rev = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "kept: end of phase 1" in by_rev[phase1_end[:12]], by_rev
    rebuilds_a_pod(tmp_path / "rebuilt", hub_url, phase1_end)




def test_checkpoints_the_pods_own_manifest_names_are_never_deleted(tmp_path, capsys):
    """After a rollback the pod's manifest names older bytes than the newest push: their hub
    copy is what a recovery pulls (`hub_revision`), so retention keeps it."""
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, {"keep": 2, "milestones": False})
    store = open_store(hub_url, pod)
    new_checkpoints(pod, 1000)
    first = push(pod, capsys)
    manifest_path = pod / load_pod_config(pod).manifest
    rolled_back = manifest_path.read_bytes()       # the manifest naming the first push
    new_checkpoints(pod, 2000)
    push(pod, capsys)
    new_checkpoints(pod, 3000)
    manifest_path.write_bytes(rolled_back)          # as a rollback to the first push leaves it
    third = push(pod, capsys)
    held = set(store.stored_objects())
    assert len(checkpoint_objects(store, first)) == GPUS
    assert set(checkpoint_objects(store, first)) <= held
    assert set(checkpoint_objects(store, third)) <= held




def test_only_the_newest_recovery_copy_is_kept_and_it_evicts_no_push(tmp_path, capsys):
    """A Ray node pushes every save at once as a recovery copy (recovery/<path>): each of
    those commits names new bytes, yet none is a push that `keep` counts (no passed push is
    evicted by them), and of the recovery copies only those the newest revision names stay,
    and those of checkpoints not judged yet."""
    from launcher.hub.lease import pod_id, push_as_writer
    from launcher.supervise.ray.recovery import recovery_path
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, {"keep": 3})
    store = open_store(hub_url, pod)
    pushes = []
    for token in (1000, 2000):
        new_checkpoints(pod, token)
        pushes.append(push(pod, capsys))
    hub_path = recovery_path(load_pod_config(pod).checkpoint_path(0))
    copies = []
    for n in range(3):
        blob = tmp_path / f"save{n}.pt"
        blob.write_bytes(os.urandom(CKPT_BYTES))
        copies.append(sha256_file(blob))
        push_as_writer(store, {hub_path: blob}, "recovery copy", None,
                       tmp_path / "lease", pod_id(pod))
    # The first copy's probe has not judged it yet: its node may still push it as passed
    # (finding its bytes on the hub, sending none), so they stay.
    CheckpointIndex(pod).add(0, {"path": str(pod / "elsewhere.pt"), "sha256": copies[0],
                                 "next_token": 2500, "bytes": CKPT_BYTES}, 1, "elsewhere.pt")
    new_checkpoints(pod, 3000)
    pushes.append(push(pod, capsys))
    held = set(store.stored_objects())
    for revision in pushes:                     # keep 3: all three passed pushes
        assert set(checkpoint_objects(store, revision)) <= held
    assert {copies[0], copies[2]} <= held and copies[1] not in held


