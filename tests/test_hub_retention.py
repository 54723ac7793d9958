"""Bounded hub storage (`retention:`): after N pushes with keep K the store holds exactly the
kept revisions' and milestones' checkpoint objects (bytes counted), on file:// and on the
test hub through the real HfApi (`list_lfs_files`, `permanently_delete_lfs_files`); kept
revisions still rebuild a pod, deleted ones are refused in one line; the budget refuses a
push with one line and an event. Pushes are the real `sync push` / HubSync code on
checkpoint files written as the worker writes them (random bytes: no training needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from launcher.cli import main as cli_main
from launcher.config.podconfig import load_config
from launcher.hub import open_store
from launcher.hub.from_hub import rebuild_from_hub
from launcher.hub.retention_ledger import CHECKPOINT_SUFFIXES, read_ledger
from launcher.hub.sync import HubSync
from launcher.hub.sync_state import read_sync_state
from launcher.pod.ckpt_index import PASSED, CheckpointIndex
from launcher.files import sha256_file
from launcher.pod.events import EventLog, read_events
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)
from tests.support.passed_checkpoints import new_checkpoints as passed_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")
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
    manifest = json.loads((pod / load_config(pod).manifest).read_text())
    for gpu in range(GPUS):
        path = pod / manifest[f"gpu_{gpu}"]["checkpoint"]
        assert sha256_file(path) == manifest[f"gpu_{gpu}"]["checkpoint_sha256"]


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
                     json.loads(store.read_bytes(load_config(pod).manifest, revisions[-1])).items()
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
    config = load_config(pod)
    manifest = read_manifest(pod / config.manifest)
    sync = HubSync(pod, config, manifest, CheckpointIndex(pod), EventLog(pod))
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
    big = load_config(pod).checkpoint_path(0)
    # Four 64 KiB checkpoints fit in 1 MiB: grow one GPU's past it.
    (pod / big).write_bytes(os.urandom(2 << 20))
    index = CheckpointIndex(pod)
    event = {"path": str(pod / big), "sha256": sha256_file(pod / big), "next_token": 2000,
             "step": 60, "ema_tf": 5.0, "lb": 1.0, "bytes": 2 << 20}
    index.add(0, event, 1, big)
    index.mark(0, event["sha256"], PASSED, "test")
    manifest = read_manifest(pod / load_config(pod).manifest)
    apply_checkpoint(manifest, 0, event, 1, pod, load_config(pod).shard_path(0))
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


def test_checkpoints_the_pods_own_manifest_names_are_never_deleted(tmp_path, capsys):
    """After a rollback the pod's manifest names older bytes than the newest push: their hub
    copy is what a recovery pulls (`hub_revision`), so retention keeps it."""
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, {"keep": 2, "milestones": False})
    store = open_store(hub_url, pod)
    new_checkpoints(pod, 1000)
    first = push(pod, capsys)
    manifest_path = pod / load_config(pod).manifest
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


def test_only_the_newest_recovery_copy_is_kept_and_it_evicts_no_push(tmp_path, capsys):
    """A Ray node pushes every save at once as a recovery copy (recovery/<path>): each of
    those commits names new bytes, yet none is a push that `keep` counts (no passed push is
    evicted by them), and of the recovery copies only those the newest revision names stay,
    and those of checkpoints not judged yet."""
    from launcher.hub.lease import pod_id, push_as_writer
    from launcher.supervise.ray_recovery import recovery_path
    hub_url = f"file://{tmp_path / 'store'}"
    pod = make_pod(tmp_path, hub_url, {"keep": 3})
    store = open_store(hub_url, pod)
    pushes = []
    for token in (1000, 2000):
        new_checkpoints(pod, token)
        pushes.append(push(pod, capsys))
    hub_path = recovery_path(load_config(pod).checkpoint_path(0))
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
    config = load_config(pod)
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
