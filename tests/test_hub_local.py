"""file:// store: revisions, history, pinned pulls, sha256 verification, path confinement."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from launcher.hub import HubError, IntegrityError, open_store
from launcher.hub.local import FileStore
from launcher.hub.by_url import absolute_hub_url
from tests.support.hub_writers import second_writer_is_refused
from tests.support.pod_files import MANIFEST, write_file

CKPT = "checkpoints/fractus_1b_gpu0.pt"


@pytest.fixture
def pod(tmp_path) -> Path:
    pod = tmp_path / "pod"
    pod.mkdir()
    return pod


def test_url_dispatch_resolves_relative_paths_against_the_pod(pod, tmp_path):
    store = open_store("file://hub", pod)
    assert isinstance(store, FileStore) and store.root == pod / "hub"
    assert open_store(f"file://{tmp_path}/elsewhere", pod).root == tmp_path / "elsewhere"
    for bad in ["s3://bucket/x", "hub", "file://", "hf://only-one-part"]:
        with pytest.raises(ValueError):
            open_store(bad, pod)


def test_a_store_named_from_elsewhere_is_the_store_the_pod_opens(pod, tmp_path):
    """absolute_hub_url (the CLI's --from, a Ray node's hub and data URLs) names the store
    open_store(url, pod) opens, from any directory; other URLs pass through."""
    url = absolute_hub_url("file://hub", pod)
    assert url == f"file://{(pod / 'hub').resolve()}"
    assert open_store(url, tmp_path / "elsewhere").root == open_store("file://hub", pod).root
    for unchanged in (None, "hf://owner/repo", f"file://{tmp_path}/abs", "file://~/hub"):
        assert absolute_hub_url(unchanged, pod) == unchanged


def test_revisions_history_and_pinned_pulls(pod, tmp_path):
    store = open_store("file://hub", pod)
    assert store.head() is None and store.history() == [] and store.files() == {}
    write_file(pod, CKPT, b"weights v1")
    write_file(pod, MANIFEST, b'{"gpu_0": {"start_token": 10}}')
    rev1 = store.push([CKPT, MANIFEST], "sync 1")
    write_file(pod, CKPT, b"weights v2, longer")
    rev2 = store.push([CKPT], "sync 2")

    assert rev1 != rev2 and store.head() == rev2
    # A revision id is the sha256 of its commit record.
    assert hashlib.sha256((pod / "hub" / "commits" / f"{rev2}.json").read_bytes()).hexdigest() == rev2
    history = store.history()
    assert [(h.revision, h.message) for h in history] == [(rev2, "sync 2"), (rev1, "sync 1")]
    assert history[0].timestamp >= history[1].timestamp and history[0].timestamp.tzinfo is not None
    # The index of rev2 still tracks the manifest pushed in rev1.
    assert set(store.files(rev2)) == {CKPT, MANIFEST}
    assert store.files(rev1)[CKPT].sha256 == hashlib.sha256(b"weights v1").hexdigest()

    fresh = tmp_path / "fresh_pod"
    other = open_store(f"file://{pod / 'hub'}", fresh)
    got = other.pull(revision=rev1[:10])  # a unique prefix pins it too
    assert got[CKPT].read_bytes() == b"weights v1" and got[MANIFEST].read_bytes().startswith(b'{"gpu_0"')
    other.pull([CKPT], revision=rev2)
    assert (fresh / CKPT).read_bytes() == b"weights v2, longer"
    other.pull([CKPT], revision=rev1)
    assert (fresh / CKPT).read_bytes() == b"weights v1"
    with pytest.raises(HubError, match="not in revision"):
        other.pull(["checkpoints/nope.pt"], revision=rev1)
    with pytest.raises(HubError, match="unknown revision"):
        other.pull(revision="deadbeefdead")


def test_push_is_one_commit_and_a_failed_push_commits_nothing(pod):
    store = open_store("file://hub", pod)
    rels = [f"checkpoints/fractus_1b_gpu{i}.pt" for i in range(8)] + [MANIFEST]
    for i, rel in enumerate(rels):
        write_file(pod, rel, os.urandom(1000 + i))
    rev = store.push(rels, "all GPUs")
    assert [h.revision for h in store.history()] == [rev]
    assert set(store.files(rev)) == set(rels)

    with pytest.raises(HubError, match="is not a file"):
        store.push([CKPT, "checkpoints/missing.pt"], "half a push")
    assert store.head() == rev and len(store.history()) == 1


def test_push_checks_recorded_hashes_in_the_copy_and_commits_nothing_on_a_mismatch(pod):
    import hashlib
    store = open_store("file://hub", pod)
    write_file(pod, MANIFEST, b"{}")
    recorded = hashlib.sha256(write_file(pod, CKPT, os.urandom(5000)).read_bytes()).hexdigest()
    rev = store.push([CKPT, MANIFEST], "recorded", expected={CKPT: recorded})
    write_file(pod, CKPT, b"other bytes")
    with pytest.raises(IntegrityError, match="changed on disk"):
        store.push([CKPT, MANIFEST], "damaged", expected={CKPT: recorded})
    assert store.head() == rev and len(store.history()) == 1


def test_pull_keeps_matching_files_and_replaces_damaged_ones(pod, tmp_path):
    store = open_store("file://hub", pod)
    write_file(pod, CKPT, b"good bytes")
    rev = store.push([CKPT], "one")
    inode = (pod / CKPT).stat().st_ino
    store.pull([CKPT], revision=rev)
    assert (pod / CKPT).stat().st_ino == inode  # already right: not rewritten

    (pod / CKPT).write_bytes(b"bad bytes!")  # same size, wrong content
    store.pull([CKPT], revision=rev)
    assert (pod / CKPT).read_bytes() == b"good bytes"


def test_corrupt_object_is_refused_and_nothing_is_installed(pod, tmp_path):
    store = open_store("file://hub", pod)
    write_file(pod, CKPT, b"the real weights")
    rev = store.push([CKPT], "one")
    obj = pod / "hub" / "objects" / store.files(rev)[CKPT].sha256[:2] / store.files(rev)[CKPT].sha256
    os.chmod(obj, 0o644)
    obj.write_bytes(b"the fake weights")  # same size: only the hash can tell

    fresh = tmp_path / "fresh"
    with pytest.raises(IntegrityError, match="refused"):
        open_store(f"file://{pod / 'hub'}", fresh).pull([CKPT], revision=rev)
    assert not (fresh / CKPT).exists()
    assert [p for p in fresh.rglob("*") if p.is_file()] == []

    write_file(fresh, CKPT, b"older weights kept")
    with pytest.raises(IntegrityError):
        open_store(f"file://{pod / 'hub'}", fresh).pull([CKPT], revision=rev)
    assert (fresh / CKPT).read_bytes() == b"older weights kept"


def test_corrupt_commit_record_is_refused(pod):
    store = open_store("file://hub", pod)
    write_file(pod, CKPT, b"x")
    rev = store.push([CKPT], "one")
    record = pod / "hub" / "commits" / f"{rev}.json"
    record.write_text(record.read_text().replace('"one"', '"two"'))
    with pytest.raises(IntegrityError, match="corrupt"):
        store.files(rev)


@pytest.mark.parametrize("bad", ["../escape.pt", "/etc/passwd", "checkpoints/../../x", "a\\..\\b", ""])
def test_paths_outside_the_pod_are_refused(pod, bad):
    store = open_store("file://hub", pod)
    write_file(pod, CKPT, b"x")
    with pytest.raises(ValueError):
        store.push({bad: pod / CKPT}, "escape")
    store.push([CKPT], "ok")
    with pytest.raises(ValueError):
        store.pull([bad])
    for reserved in ["hub_index.json", "hub/refs/main", ".fractus_hub/x"]:
        with pytest.raises(ValueError, match="reserved"):
            store.push({reserved: pod / CKPT}, "reserved name")  # the store lives in pod/hub


def test_an_index_naming_a_path_outside_the_pod_is_refused(pod, tmp_path):
    """A commit record whose index says '../x' (crafted, but correctly hashed) is not followed."""
    store = open_store("file://hub", pod)
    write_file(pod, CKPT, b"payload")
    rev = store.push([CKPT], "one")
    record = json.loads((pod / "hub" / "commits" / f"{rev}.json").read_text())
    index = json.loads(record["index"])
    index["files"]["../../outside.pt"] = index["files"].pop(CKPT)
    record["index"] = json.dumps(index)
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    evil = hashlib.sha256(data).hexdigest()
    (pod / "hub" / "commits" / f"{evil}.json").write_bytes(data)
    (pod / "hub" / "refs" / "main").write_text(evil)

    with pytest.raises(IntegrityError, match="invalid"):
        store.pull()
    assert not (tmp_path / "outside.pt").exists()


def test_symlink_escaping_the_pod_is_refused(pod, tmp_path):
    store = open_store("file://hub", pod)
    write_file(pod, CKPT, b"x")
    rev = store.push([CKPT], "one")
    fresh, outside = tmp_path / "fresh", tmp_path / "outside"
    fresh.mkdir()
    outside.mkdir()
    (fresh / "checkpoints").symlink_to(outside)
    with pytest.raises(ValueError, match="outside"):
        open_store(f"file://{pod / 'hub'}", fresh).pull([CKPT], revision=rev)
    assert list(outside.iterdir()) == []


def test_two_writers_cannot_silently_overwrite_each_other(pod, tmp_path):
    pod_b = tmp_path / "pod_b"
    a = open_store("file://hub", pod)
    b = open_store(f"file://{pod / 'hub'}", pod_b)
    rev0, rev1 = second_writer_is_refused(a, pod, b, pod_b)

    # A change to other paths is re-applied on top of A's work, keeping both.
    write_file(pod_b, CKPT, b"B's checkpoint")
    rev2 = b.push([CKPT], "B checkpoint", base=rev0)
    assert a.history()[0].revision == rev2 and a.history()[1].revision == rev1
    assert set(a.files(rev2)) == {MANIFEST, CKPT}
    assert a.files(rev2)[MANIFEST] == a.files(rev1)[MANIFEST]


def test_reading_one_small_file_reads_the_revision_index_once(pod, monkeypatch):
    """`read_bytes` (the run's lease, read before every push) reads the index once: on
    hf:// each read is a download."""
    store = open_store("file://hub", pod)
    (pod / "note.txt").write_text("lease")
    revision = store.push(["note.txt"], "one file")
    reads = []
    index = FileStore._index
    monkeypatch.setattr(FileStore, "_index", lambda self, rev: reads.append(rev) or index(self, rev))
    assert store.read_bytes("note.txt", revision) == b"lease"
    assert reads == [revision]
    assert store.read_bytes("absent.txt", revision) is None
