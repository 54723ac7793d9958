"""One writer per hub run (issue 10, item 17): the lease in the hub (launcher/hub/lease.py).

A pod rebuilt with `launch --from-hub` takes the run's lease over; the pod it came from is
refused at its next push ("run taken over by pod X at T"), stops pushing, and says so in
its events and `status`. A takeover landing between a push's read of the lease and its
commit makes that push fail (parent_commit), never both pods win.

With the file:// store: the whole path through the real CLI, launcher and tiny CPU workers.
With the hf:// test hub (real huggingface_hub client): the same protocol at the API the CLI
uses (`rebuild_from_hub`, `sync push`), and the race.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from launcher.hub.from_hub import rebuild_from_hub
from launcher.hub import open_store
from launcher.hub.lease import (LEASE_PATH, RunTakenOver, hub_lease, pod_id, push_as_writer,
                                take_over)
from launcher.paths import HELD_FILE
from launcher.supervise.ray.node_checkpoints import push_as_pod
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)
from tests.support.e2e import REPO, events_of, make_pod
from tests.support.hub_pod import FAST_PASS, add_passed

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def fractus_pod(pod: Path, *args: str, timeout: float = 240):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


def held_id(pod: Path) -> str:
    return json.loads((pod / HELD_FILE).read_text())["pod_id"]


def test_from_hub_takes_the_run_over_and_the_old_pod_stops_pushing(tmp_path, monkeypatch):
    old = make_pod(tmp_path / "a", criteria=FAST_PASS)        # hub: file://hub (in the pod)
    done = fractus_pod(old, "launch", "--stage", "1", "--gpus", "0", "--max-steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert events_of(old, "sync_pushed")
    store = open_store(f"file://{old / 'hub'}", tmp_path)
    first = hub_lease(store, store.head())
    assert first["pod_id"] == held_id(old) and first["epoch"] == 1

    new = tmp_path / "b" / "pod"
    done = fractus_pod(new, "launch", "--from-hub", f"file://{old / 'hub'}", "--gpus", "0",
                       "--max-steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    (rebuilt,) = events_of(new, "rebuilt_from_hub")
    assert rebuilt["pod_id"] == held_id(new) != held_id(old)
    assert (rebuilt["lease_epoch"], rebuilt["previous_pod"]) == (2, held_id(old))
    assert events_of(new, "sync_pushed")                      # the new pod writes the run
    head = store.head()
    assert hub_lease(store, head)["pod_id"] == held_id(new)

    # The old pod's next push, by hand: refused, one line naming the new pod; nothing sent.
    refused = fractus_pod(old, "sync", "push")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr.startswith(f"error: run taken over by pod {held_id(new)} at ")
    assert store.head() == head
    status = json.loads(fractus_pod(old, "status", "--json").stdout)
    assert status["sync"]["taken_over"].startswith(f"run taken over by pod {held_id(new)}")
    monkeypatch.setenv("COLUMNS", "300")     # the headline unwrapped: the pod's path is long
    table = fractus_pod(old, "status").stdout
    # The headline says it, under the pod's line (before: one line after the table).
    assert table.splitlines()[1].startswith(f"HUB TAKEN OVER: run taken over by pod "
                                            f"{held_id(new)}"), table

    # Its launcher is refused before any worker starts (tests/test_hub_lease_launch.py);
    # one taken over while it runs: tests/test_hub_lease_launch.py too.
    done = fractus_pod(old, "launch", "--gpus", "0", "--max-steps", "2")
    assert done.returncode == 2 and "--no-hub" in done.stderr, done.stdout + done.stderr
    assert store.head() == head


@pytest.mark.parametrize("kind", ["file", "hf"])
def test_a_takeover_between_read_and_commit_refuses_the_push(kind, tmp_path, request):
    if kind == "hf":
        request.getfixturevalue("test_hub")    # the server; HF_ENDPOINT, HF_TOKEN for the client
        url = "hf://fractus/lease-race"
    else:
        url = f"file://{tmp_path / 'hub'}"
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "x.bin").write_bytes(b"one")
    store = open_store(url, old)
    first = push_as_writer(store, {"x.bin": old / "x.bin"}, "first", None, old / "stage",
                           pod_id(old))
    assert hub_lease(store, first)["pod_id"] == held_id(old)
    real_push = store.push

    def push_after_a_takeover(*args, **kwargs):
        take_over(open_store(url, new), new)       # lands after the old pod read the lease
        return real_push(*args, **kwargs)

    store.push = push_after_a_takeover
    (old / "x.bin").write_bytes(b"two")
    with pytest.raises(RunTakenOver) as refused:
        push_as_writer(store, {"x.bin": old / "x.bin"}, "second", None, old / "stage",
                       pod_id(old))
    assert str(refused.value).startswith(f"run taken over by pod {held_id(new)} at ")
    head = store.head()
    assert hub_lease(store, head)["pod_id"] == held_id(new)
    assert hub_lease(store, head)["epoch"] == 2
    assert store.read_bytes("x.bin", head) == b"one"          # the old pod's push: not in
    assert LEASE_PATH in store.files(head)


def test_hf_hub_run_rebuilt_elsewhere_refuses_the_old_pods_push(test_hub, tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    url = "hf://fractus/lease-run"
    old = tmp_path / "old"
    assert cli_main(["--pod-dir", str(old), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    text = (old / "fractus-pod.yaml").read_text().replace("hub: file://hub", f"hub: {url}")
    (old / "fractus-pod.yaml").write_text(text)
    add_passed(old, 0, 100)
    assert cli_main(["--pod-dir", str(old), "sync", "push"]) == 0
    # sync pull into a new folder from the hf:// hub alone (item 16): no config needed.
    fresh = tmp_path / "pulled" / "pod"
    assert cli_main(["--pod-dir", str(fresh), "sync", "pull", "--from", url]) == 0
    assert (fresh / "checkpoints" / "fractus_1b_gpu0.pt").read_bytes() == \
        (old / "checkpoints" / "fractus_1b_gpu0.pt").read_bytes()
    assert f"hub: {url}" in (fresh / "fractus-pod.yaml").read_text()
    assert not (fresh / LEASE_PATH).exists()               # the hub's record stays there
    lease = rebuild_from_hub(tmp_path / "new", url, None).take_run()
    assert lease["epoch"] == 2 and lease["previous_pod"] == held_id(old)
    commits_before = len(test_hub.commits("fractus/lease-run"))

    add_passed(old, 0, 200)
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(old), "sync", "push"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: run taken over by pod {lease['pod_id']} at ")
    assert len(test_hub.commits("fractus/lease-run")) == commits_before
    (event,) = events_of(old, "hub_taken_over")
    assert lease["pod_id"] in event["error"]


def test_concurrent_pushes_of_one_writer_both_land(tmp_path):
    """Several GPUs' nodes push at once as one pod: a conflict between them (each first push
    staging its own new lease, on the head both read) is retried, never an error."""
    url = f"file://{tmp_path / 'hub'}"
    writer = "head-pod-1234"
    barrier = threading.Barrier(2, timeout=60)
    revisions, errors = {}, []

    def node_push(gpu: int) -> None:
        workdir = tmp_path / f"node{gpu}"
        workdir.mkdir()
        (workdir / "ckpt.pt").write_bytes(f"gpu{gpu}".encode())
        store = open_store(url, workdir)
        real_push, calls = store.push, []

        def push_after_both_read(*args, **kwargs):
            if not calls:           # both pushes read the (empty) head before either commits
                calls.append(1)
                barrier.wait()
            return real_push(*args, **kwargs)

        store.push = push_after_both_read
        try:
            revisions[gpu] = push_as_writer(store, {f"ckpt{gpu}.pt": workdir / "ckpt.pt"},
                                            f"gpu{gpu}", None, workdir / "stage", writer)
        except Exception as exc:        # noqa: BLE001 (asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=node_push, args=(gpu,)) for gpu in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(revisions) == 2
    store = open_store(url, tmp_path)
    head = store.head()
    assert store.read_bytes("ckpt0.pt", head) == b"gpu0"
    assert store.read_bytes("ckpt1.pt", head) == b"gpu1"
    assert hub_lease(store, head)["pod_id"] == writer and hub_lease(store, head)["epoch"] == 1
    assert len(store.history()) == 2
    assert not list((tmp_path / "node0" / "stage").iterdir())     # no lease file left


def test_a_node_pushes_as_its_heads_pod_and_is_refused_after_a_takeover(tmp_path):
    """A Ray node (ray.node_checkpoints.push_as_pod, what NodeCheckpoints.push sends) pushes as the head's pod,
    whose id is not on the node's disk: the commit carries the head's lease; once another
    pod took the run over, the node's push is refused and nothing is committed."""
    url = f"file://{tmp_path / 'hub'}"
    head_pod, node, new = tmp_path / "head", tmp_path / "node", tmp_path / "new"
    for folder in (head_pod, node, new):
        folder.mkdir()
    writer = pod_id(head_pod)
    ckpt = node / "checkpoints" / "retained" / "gpu0.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"first")
    first = push_as_pod(url, node, writer, "checkpoints/fractus_1b_gpu0.pt", ckpt,
                        hashlib.sha256(b"first").hexdigest(), "node push")
    store = open_store(url, head_pod)
    assert store.head() == first
    assert hub_lease(store, first)["pod_id"] == writer
    assert not (node / HELD_FILE).exists()                  # the node is no pod of its own

    lease = take_over(open_store(url, new), new)
    taken = store.head()
    ckpt.write_bytes(b"second")
    with pytest.raises(RunTakenOver) as refused:
        push_as_pod(url, node, writer, "checkpoints/fractus_1b_gpu0.pt", ckpt,
                    hashlib.sha256(b"second").hexdigest(), "node push")
    assert str(refused.value).startswith(f"run taken over by pod {lease['pod_id']} at ")
    assert store.head() == taken
    assert store.read_bytes("checkpoints/fractus_1b_gpu0.pt", taken) == b"first"
