"""hf:// store through the real HfApi against the protocol-level test hub on loopback."""

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from launcher.hub import HubError, IntegrityError, RetryPolicy, open_store
from tests.support.hub_repo import Blob, git_oid
from tests.support.hub_writers import second_writer_is_refused
from tests.support.pod_files import MANIFEST, write_file
from tests.support.hub_server import TEST_TOKEN, test_hub  # noqa: F401  (pytest fixture)

# The client itself sends raw upload bodies with httpx's deprecated `data=`: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

REPO = "fractus/run-1"
FAST = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05)
CKPTS = [f"checkpoints/fractus_1b_gpu{i}.pt" for i in range(8)]


def _store(hub, pod: Path, **kw):
    return open_store(f"hf://{REPO}", pod, retry=kw.pop("retry", FAST), **kw)


def _pushed_once(hub, tmp_path):
    """A store whose first push (a 1 MiB checkpoint) landed, and how many commits the hub
    holds after it."""
    pod = tmp_path / "pod"
    write_file(pod, CKPTS[0], os.urandom(1 << 20))
    store = _store(hub, pod)
    store.push([CKPTS[0]], "first")
    return store, len(hub.commits(REPO))


def _leftovers(pod: Path) -> list[Path]:
    """Staging or partial files a pull must never leave behind."""
    return [p for p in pod.rglob("*") if ".fractus_hub" in p.parts or p.name.endswith((".partial", ".incomplete"))]


def test_round_trip_creates_a_private_repo_and_pins_the_revision(test_hub, tmp_path):
    pod = tmp_path / "pod"
    write_file(pod, CKPTS[0], os.urandom(3 << 20))  # a .pt: goes through the LFS batch API
    write_file(pod, MANIFEST, b'{"gpu_0": {"start_token": 123}}')  # small text: a regular file
    store = _store(test_hub, pod)
    assert store.head() is None and store.history() == []

    rev1 = store.push([CKPTS[0], MANIFEST], "sync 1")
    v1 = (pod / CKPTS[0]).read_bytes()
    write_file(pod, CKPTS[0], os.urandom(3 << 20))
    rev2 = store.push([CKPTS[0]], "sync 2")

    assert test_hub.state.repo("model", REPO).private
    assert test_hub.routed("lfs_upload") and test_hub.routed("lfs_verify")
    fresh = tmp_path / "fresh"
    got = _store(test_hub, fresh).pull(revision=rev1)
    assert set(got) == {CKPTS[0], MANIFEST}
    assert (fresh / CKPTS[0]).read_bytes() == v1
    assert json.loads((fresh / MANIFEST).read_text()) == {"gpu_0": {"start_token": 123}}
    _store(test_hub, fresh).pull([CKPTS[0]])  # head = rev2
    assert (fresh / CKPTS[0]).read_bytes() == (pod / CKPTS[0]).read_bytes()
    assert [h.message for h in store.history()][:2] == ["sync 2", "sync 1"]
    assert store.history()[0].revision == rev2
    assert _leftovers(fresh) == []
    # Every download named a commit id, never a branch.
    assert test_hub.routed("resolve") and not any("/resolve/main/" in r.path for r in test_hub.routed("resolve"))
    assert any(f"/resolve/{rev1}/{CKPTS[0]}" in r.path for r in test_hub.routed("resolve"))


def test_push_of_eight_checkpoints_and_manifest_is_one_commit(test_hub, tmp_path):
    pod = tmp_path / "pod"
    for i, rel in enumerate(CKPTS):
        write_file(pod, rel, os.urandom((1 << 20) + i))
    write_file(pod, MANIFEST, json.dumps({f"gpu_{i}": {"start_token": i * 1000} for i in range(8)}).encode())
    store = _store(test_hub, pod)
    store.push([MANIFEST], "before")
    before = len(test_hub.commits(REPO))
    commits_sent = len(test_hub.routed("commit"))

    rev = store.push([*CKPTS, MANIFEST], "hourly sync")

    listed = HfApi(endpoint=test_hub.url).list_repo_commits(REPO)
    assert len(listed) == before + 1 and listed[0].commit_id == rev and listed[0].title == "hourly sync"
    assert len(test_hub.routed("commit")) == commits_sent + 1
    tree = test_hub.commits(REPO)[0].tree
    assert set(CKPTS) | {MANIFEST, "hub_index.json"} <= set(tree)
    index = json.loads(tree["hub_index.json"].content)["files"]
    for rel in CKPTS:
        assert index[rel]["sha256"] == hashlib.sha256((pod / rel).read_bytes()).hexdigest()
        assert tree[rel].sha256 == index[rel]["sha256"]  # stored through LFS under that oid


def test_parent_commit_stops_a_second_writer_overwriting_the_manifest(test_hub, tmp_path):
    pod_a, pod_b = tmp_path / "a", tmp_path / "b"
    a, b = _store(test_hub, pod_a), _store(test_hub, pod_b)
    second_writer_is_refused(a, pod_a, b, pod_b)
    assert test_hub.commits(REPO)[0].tree[MANIFEST].content == (pod_a / MANIFEST).read_bytes()


def test_racing_writer_on_other_paths_is_rebased_not_lost(test_hub, tmp_path):
    """Writer B's commit names the head it read; A commits first; B re-reads and re-applies."""
    pod_a, pod_b = tmp_path / "a", tmp_path / "b"
    a, b = _store(test_hub, pod_a), _store(test_hub, pod_b)
    write_file(pod_a, CKPTS[0], b"A0" * 1000)
    a.push([CKPTS[0]], "A first")
    write_file(pod_a, CKPTS[1], b"A1" * 1000)
    write_file(pod_b, CKPTS[2], b"B2" * 1000)
    racer = threading.Thread(target=lambda: a.push([CKPTS[1]], "A races"))
    test_hub.faults.add("commit", "call", fn=lambda: (racer.start(), racer.join()))

    rev = b.push([CKPTS[2]], "B")

    messages = [c.title for c in test_hub.commits(REPO)]
    assert messages[:3] == ["B", "A races", "A first"]
    assert set(b.files(rev)) == {CKPTS[0], CKPTS[1], CKPTS[2]}
    assert len([r for r in test_hub.routed("commit")]) == 4  # A, A-race, B refused (412), B again


def test_server_errors_are_retried_and_give_a_clear_error_when_they_persist(test_hub, tmp_path):
    store, n = _pushed_once(test_hub, tmp_path)

    test_hub.faults.add("commit", "status", count=2, status=500)
    test_hub.faults.add("repo_info", "status", count=1, status=503)
    rev = store.push([CKPTS[0]], "after two 500s")
    assert test_hub.commits(REPO)[0].oid == rev and len(test_hub.commits(REPO)) == n + 1

    test_hub.faults.add("commit", "status", count=100, status=502)
    with pytest.raises(HubError) as err:
        store.push([CKPTS[0]], "never lands")
    assert "HTTP 502" in str(err.value) and "\n" not in str(err.value)
    assert len(test_hub.commits(REPO)) == n + 1


def test_push_checks_recorded_hashes_before_sending_a_byte(test_hub, tmp_path):
    pod = tmp_path / "pod"
    good = write_file(pod, CKPTS[0], os.urandom(2 << 20))
    recorded = hashlib.sha256(good.read_bytes()).hexdigest()
    write_file(pod, MANIFEST, b"{}")
    store = _store(test_hub, pod)
    rev = store.push([CKPTS[0], MANIFEST], "recorded", expected={CKPTS[0]: recorded})
    assert store.files(rev)[CKPTS[0]].sha256 == recorded
    n, uploads = len(test_hub.commits(REPO)), len(test_hub.routed("lfs_upload"))

    write_file(pod, CKPTS[1], os.urandom(2 << 20))          # bytes that are not the recorded ones
    with pytest.raises(IntegrityError, match="changed on disk") as err:
        store.push([CKPTS[1], MANIFEST], "damaged", expected={CKPTS[1]: recorded})
    assert "\n" not in str(err.value)
    assert store.head() == rev and len(test_hub.commits(REPO)) == n
    assert len(test_hub.routed("lfs_upload")) == uploads     # no object under a wrong hash


def test_lost_commit_answer_is_not_committed_twice(test_hub, tmp_path):
    store, n = _pushed_once(test_hub, tmp_path)
    test_hub.faults.add("commit", "drop_after")  # the commit lands, its answer is lost
    test_hub.faults.add("preupload", "drop")  # and a connection drops before it

    rev = store.push([CKPTS[0]], "answer lost")

    commits = test_hub.commits(REPO)
    assert len(commits) == n + 1 and commits[0].oid == rev and commits[0].title == "answer lost"


def test_download_cut_midway_is_fetched_again_and_verified(test_hub, tmp_path):
    pod = tmp_path / "pod"
    data = os.urandom(4 << 20)
    write_file(pod, CKPTS[0], data)
    rev = _store(test_hub, pod).push([CKPTS[0]], "one")
    test_hub.faults.add("resolve", "truncate", method="GET", path_contains=CKPTS[0])

    fresh = tmp_path / "fresh"
    _store(test_hub, fresh).pull([CKPTS[0]], revision=rev)

    assert (fresh / CKPTS[0]).read_bytes() == data
    # The cut GET was followed by another one (resumed with Range, or from the start).
    assert len([r for r in test_hub.routed("resolve", "GET") if r.path.endswith(CKPTS[0])]) == 2
    assert _leftovers(fresh) == []


def test_corrupt_download_is_fetched_again_or_refused_never_used(test_hub, tmp_path):
    pod = tmp_path / "pod"
    data = os.urandom(2 << 20)
    write_file(pod, CKPTS[0], data)
    rev = _store(test_hub, pod).push([CKPTS[0]], "one")
    fresh = tmp_path / "fresh"

    test_hub.faults.add("resolve", "corrupt", method="GET", count=1, path_contains=CKPTS[0])
    _store(test_hub, fresh).pull([CKPTS[0]], revision=rev)
    assert (fresh / CKPTS[0]).read_bytes() == data

    write_file(fresh, CKPTS[0], b"older local weights")
    test_hub.faults.clear()
    test_hub.faults.add("resolve", "corrupt", method="GET", count=100, path_contains=CKPTS[0])
    with pytest.raises(IntegrityError, match="refused"):
        _store(test_hub, fresh).pull([CKPTS[0]], revision=rev)
    assert (fresh / CKPTS[0]).read_bytes() == b"older local weights"
    assert _leftovers(fresh) == []

    empty = tmp_path / "empty"
    with pytest.raises(IntegrityError):
        _store(test_hub, empty).pull([CKPTS[0]], revision=rev)
    assert not (empty / CKPTS[0]).exists()


def test_slow_metadata_answer_times_out_and_is_retried(test_hub, tmp_path):
    pod = tmp_path / "pod"
    write_file(pod, CKPTS[0], os.urandom(1 << 20))
    rev = _store(test_hub, pod).push([CKPTS[0]], "one")
    test_hub.faults.add("resolve", "slow", method="HEAD", delay=2.0, path_contains=CKPTS[0])
    heads = len(test_hub.routed("resolve", "HEAD"))

    fresh = tmp_path / "fresh"
    _store(test_hub, fresh, timeout_s=0.5).pull(revision=rev)

    assert (fresh / CKPTS[0]).read_bytes() == (pod / CKPTS[0]).read_bytes()
    assert len(test_hub.routed("resolve", "HEAD")) == heads + 3  # index once, the file twice


def test_an_index_naming_a_path_outside_the_pod_is_refused(test_hub, tmp_path):
    pod = tmp_path / "pod"
    write_file(pod, CKPTS[0], b"payload")
    _store(test_hub, pod).push([CKPTS[0]], "one")
    repo = test_hub.state.repo("model", REPO)
    index = json.loads(repo.resolve("main").tree["hub_index.json"].content)
    index["files"]["../../outside.pt"] = index["files"].pop(CKPTS[0])
    data = json.dumps(index).encode()
    blob = Blob(len(data), git_oid(data), content=data)
    test_hub.state.commit(repo, "main", None, "tampered", "", [])
    repo.resolve("main").tree["hub_index.json"] = blob

    fresh = tmp_path / "fresh"
    with pytest.raises(IntegrityError, match="invalid"):
        _store(test_hub, fresh).pull()
    assert not (tmp_path / "outside.pt").exists()


def test_missing_repo_and_dataset_urls(test_hub, tmp_path):
    store = _store(test_hub, tmp_path / "pod")
    assert store.head() is None and store.history() == []
    with pytest.raises(HubError, match="unknown revision"):
        store.pull()
    pod = tmp_path / "pod"
    write_file(pod, "data/shard_phase2_gpu0.npy", os.urandom(4096))
    ds = open_store("hf://datasets/fractus/shards", pod, retry=FAST)
    rev = ds.push(["data/shard_phase2_gpu0.npy"], "shards")
    assert test_hub.state.repo("dataset", "fractus/shards").resolve("main").oid == rev


def test_token_never_appears_in_logs_errors_or_files(test_hub, tmp_path, caplog, capfd):
    caplog.set_level("DEBUG")
    caplog.set_level("DEBUG", logger="huggingface_hub")
    pod = tmp_path / "pod"
    write_file(pod, CKPTS[0], os.urandom(2 << 20))
    write_file(pod, MANIFEST, b"{}")
    store = _store(test_hub, pod)
    messages = [repr(store)]
    rev = store.push([CKPTS[0], MANIFEST], "sync")
    test_hub.faults.add("commit", "status", count=100, status=500)
    test_hub.faults.add("resolve", "corrupt", method="GET", count=100, path_contains=CKPTS[0])
    for action in (lambda: store.push([MANIFEST], "fails"),
                   lambda: _store(test_hub, tmp_path / "fresh").pull([CKPTS[0]], revision=rev),
                   lambda: _store(test_hub, pod, token="hf_wrong_token").push([MANIFEST], "401")):
        with pytest.raises(HubError) as err:
            action()
        messages += [str(err.value), repr(err.value)]
    explicit = open_store(f"hf://{REPO}", pod, token=TEST_TOKEN)
    messages.append(repr(explicit))

    out, errout = capfd.readouterr()
    texts = [caplog.text, out, errout, *messages]
    assert caplog.text  # the scan below saw real log output
    assert all(TEST_TOKEN not in t for t in texts)
    for root in (pod, tmp_path / "fresh"):
        for path in root.rglob("*"):
            if path.is_file():
                assert TEST_TOKEN.encode() not in path.read_bytes(), path
    # ... and the token was really used: the hub authenticated our requests.
    assert all(r.authenticated for r in test_hub.routed("commit"))


def test_token_from_the_clients_login_cache_when_hf_token_is_unset(test_hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.delenv("HF_TOKEN")
    pod = tmp_path / "pod"
    write_file(pod, MANIFEST, b"{}")
    with pytest.raises(HubError, match="HTTP 401"):
        _store(test_hub, pod).push([MANIFEST], "no token anywhere")
    token_file = Path(constants.HF_TOKEN_PATH)  # the fixture points it into tmp_path
    token_file.parent.mkdir(parents=True, exist_ok=True)
    token_file.write_text(TEST_TOKEN)
    rev = _store(test_hub, pod).push([MANIFEST], "token from the login cache")
    assert test_hub.commits(REPO)[0].oid == rev


def test_test_hub_answers_tree_and_repo_info_like_the_hub(test_hub, tmp_path):
    """The listing calls a launcher may use to inspect a run (HfApi.list_repo_tree, model_info)."""
    pod = tmp_path / "pod"
    write_file(pod, CKPTS[0], os.urandom(1 << 20))
    write_file(pod, MANIFEST, b"{}")
    rev = _store(test_hub, pod).push([CKPTS[0], MANIFEST], "one")
    api = HfApi(endpoint=test_hub.url)

    top = {e.path: type(e).__name__ for e in api.list_repo_tree(REPO, revision=rev)}
    assert top == {".gitattributes": "RepoFile", "hub_index.json": "RepoFile", "checkpoints": "RepoFolder"}
    files = {e.path: e for e in api.list_repo_tree(REPO, recursive=True) if type(e).__name__ == "RepoFile"}
    assert files[CKPTS[0]].lfs.sha256 == hashlib.sha256((pod / CKPTS[0]).read_bytes()).hexdigest()
    assert files[MANIFEST].lfs is None and files[MANIFEST].size == 2
    info = api.model_info(REPO, revision=rev)
    assert info.sha == rev and info.private and {s.rfilename for s in info.siblings} >= {CKPTS[0], MANIFEST}
