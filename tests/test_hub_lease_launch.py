"""When a launch takes the run's hub lease, and when it refuses to train because another
pod holds it (launcher/hub/lease.py, launcher/supervise/prepare.py, launcher/cli/launch.py).

A `launch --from-hub` that is refused (here: a shard of its `data:` store with other bytes
than recorded) refuses before it takes the lease: its directory is left empty, the hub
untouched, and the pod that writes the run keeps pushing. A pod whose run another pod took
over is refused before any worker starts (exit 2, one line naming the command that trains
without the hub), and that command, run as printed, trains with no push.

Real CLI in child processes, real file:// stores, tiny CPU workers.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from launcher.errors import UserError
from launcher.hub import open_store
from launcher.hub.from_hub import rebuild_from_hub
from launcher.hub.lease import LEASE_PATH, hub_lease, pod_id, take_over
from launcher.hub.sync_state import update_sync_state
from launcher.supervise.plan import load_plan
from launcher.supervise.prepare import refuse_taken_over
from tests.support.e2e import (PROCESS_S, REPO, Launcher, events_of, kill_workers,  # noqa: F401
                               launchers, make_pod, wait_for, worker_records)
from tests.support.from_hub import fractus_pod
from tests.support.hub_pod import FAST_PASS, add_passed


def files_of(pod: Path) -> dict[str, bytes]:
    return {str(p.relative_to(pod)): p.read_bytes() for p in sorted(pod.rglob("*"))
            if p.is_file()}


def test_a_refused_rebuild_leaves_its_directory_empty_and_the_lease_untouched(tmp_path):
    old = tmp_path / "old"
    assert cli_main(["--pod-dir", str(old), "init", "--preset", "tiny-cpu"]) == 0
    data = tmp_path / "data"
    assert cli_main(["--pod-dir", str(old), "data", "push", "--to", f"file://{data}"]) == 0
    for gpu in (0, 1):
        add_passed(old, gpu, 64)
    assert cli_main(["--pod-dir", str(old), "sync", "push"]) == 0
    store = open_store(f"file://{old / 'hub'}", tmp_path)
    head = store.head()
    assert hub_lease(store, head)["pod_id"] == pod_id(old)
    # One shard's bytes in the data store damaged (its object, named by its sha256).
    shard = (old / "data" / "shard_phase2_gpu0.npy").read_bytes()
    (damaged,) = [p for p in (data / "objects").rglob("*") if p.is_file()
                  and p.read_bytes() == shard]
    damaged.chmod(0o644)
    damaged.write_bytes(shard[:-4] + b"XXXX")

    new = tmp_path / "new" / "pod"
    done = fractus_pod(new, "launch", "--from-hub", f"file://{old / 'hub'}", "--max-steps", "1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "shard_phase2_gpu0.npy" in done.stderr and "Traceback" not in done.stderr
    # Before: "this pod ... now writes the run (lease epoch 2)", and the directory full.
    assert "now writes the run" not in done.stdout, done.stdout
    assert not new.exists()                            # as it was: the command can be rerun
    assert store.head() == head                        # the hub untouched: no lease taken
    # The pod that writes the run still does: its next push lands.
    add_passed(old, 0, 128)
    assert cli_main(["--pod-dir", str(old), "sync", "push"]) == 0
    assert store.head() != head and hub_lease(store, store.head())["pod_id"] == pod_id(old)


def test_a_pod_taken_over_is_refused_before_any_worker_unless_it_trains_without_the_hub(
        tmp_path):
    pod = make_pod(tmp_path)                       # hub: file://hub (in the pod); fresh starts
    url = f"file://{pod / 'hub'}"
    pod_id(pod)                                    # this pod has an id ...
    other = tmp_path / "other"
    other.mkdir()
    lease = take_over(open_store(url, other), other)   # ... and another pod holds the run
    head = open_store(url, pod).head()
    before = files_of(pod)

    refused = fractus_pod(pod, "launch", "--gpus", "0", "--max-steps", "2")
    # Before: it trained, and only its final push was refused (exit 0).
    assert refused.returncode == 2, refused.stdout + refused.stderr
    (line,) = refused.stderr.splitlines()
    assert line.startswith(f"error: hub file://hub: run taken over by pod {lease['pod_id']} ")
    assert not worker_records(pod, 0, "start")             # no worker started
    assert files_of(pod) == before                         # a refusal changes nothing on disk

    # The command it names, run as printed, trains without the hub: no push, no refusal.
    command = shlex.split(line.rsplit("): ", 1)[1])
    assert command[:1] == ["fractus-pod"] and "--no-hub" in command
    done = subprocess.run([sys.executable, "-m", "launcher.cli", *command[1:]], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    kill_workers(pod)
    assert done.returncode == 0, done.stdout + done.stderr
    assert worker_records(pod, 0, "start")
    assert not events_of(pod, "sync_pushed") and not events_of(pod, "hub_taken_over")
    assert open_store(url, pod).head() == head


def test_a_relative_from_hub_store_is_taken_from_the_current_directory_and_said_so(
        tmp_path, monkeypatch):
    """One rule for a relative file:// path, and the error states it: `--from-hub
    file://hub` is taken from the current directory (before: the error said "taken from
    the pod directory", which it never was)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    new = tmp_path / "new"
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(new),
                           "launch", "--from-hub", "file://hub"], cwd=elsewhere,
                          env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert f"no hub store at {elsewhere / 'hub'}" in line
    assert "typed on the command line, from the current directory" in line, line
    assert not new.exists()
    # From the folder that holds it, the same URL names that store.
    old = tmp_path / "old"
    assert cli_main(["--pod-dir", str(old), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    add_passed(old, 0, 64)
    assert cli_main(["--pod-dir", str(old), "sync", "push"]) == 0
    monkeypatch.chdir(old)
    rebuilt = rebuild_from_hub(new, "file://hub", None)
    assert rebuilt.url == f"file://{old / 'hub'}"
    assert f"hub: file://{old / 'hub'}" in (new / "fractus-pod.yaml").read_text()


def test_a_run_taken_over_while_the_pod_trains_is_not_pushed_and_its_last_line_says_so(
        tmp_path, launchers):
    """The launch found the run its own; another pod takes it over while it trains: its
    final push is refused, it pushes no more, and its last line says the hub was not
    updated (before: "final push to file://hub", "pod STOPPED", as if pushed)."""
    pod = make_pod(tmp_path)
    url = f"file://{pod / 'hub'}"
    running = Launcher(pod, "--gpus", "0")
    launchers.append(running)
    wait_for(lambda: worker_records(pod, 0, "start"), PROCESS_S, "GPU 0's worker")
    other = tmp_path / "other"
    other.mkdir()
    lease = take_over(open_store(url, other), other)
    head = open_store(url, pod).head()
    assert fractus_pod(pod, "stop").returncode == 0
    assert running.wait(PROCESS_S) == 0, running.output()
    output = running.output()
    last = output.strip().splitlines()[-1]
    assert last.startswith("hub ") and "NOT updated: run taken over by pod " in last, last
    if "final push to" in output:
        assert "REFUSED: run taken over by pod" in output, output
    (taken,) = [e for e in events_of(pod, "hub_taken_over") if e["reason"] != "by hand"]
    assert lease["pod_id"] in taken["error"]
    assert open_store(url, pod).head() == head


def test_a_hub_that_cannot_be_read_leaves_it_to_the_pods_own_record(tmp_path):
    """The lease at the hub's head decides; a hub that cannot be read now (here: a lease
    that is not JSON) refuses nothing, but this pod's own record of a refused push to the
    same hub (what `status` shows as HUB TAKEN OVER) still refuses the launch."""
    pod = make_pod(tmp_path)
    plan, _manifest = load_plan(pod, None, None, "0")
    refuse_taken_over(plan, "CMD")                      # an empty hub: this pod's to write
    garbage = tmp_path / "lease.json"
    garbage.write_text("not json")
    open_store("file://hub", pod).push({LEASE_PATH: garbage}, "a damaged lease")
    refuse_taken_over(plan, "CMD")                      # unreadable, and no record: go on
    taken = "run taken over by pod elsewhere-1 at T (lease epoch 2)"
    update_sync_state(pod, hub="file://other", taken_over=taken)
    refuse_taken_over(plan, "CMD")                      # a record of another hub
    update_sync_state(pod, hub="file://hub")
    with pytest.raises(UserError) as refused:
        refuse_taken_over(plan, "CMD")
    assert taken in str(refused.value) and str(refused.value).endswith(": CMD")


def test_a_pod_rebuilt_without_the_hub_trains_and_leaves_the_run_to_its_writer(tmp_path):
    """`launch --from-hub URL --no-hub`: rebuilt and trained, the lease untouched (the pod
    that writes the run still pushes to it); the rebuilt pod's plain launch is then refused,
    as any pod's whose run another pod writes."""
    old = make_pod(tmp_path / "a", criteria=FAST_PASS)
    done = fractus_pod(old, "launch", "--stage", "1", "--gpus", "0", "--max-steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    store = open_store(f"file://{old / 'hub'}", old)
    head = store.head()
    new = tmp_path / "new"
    done = fractus_pod(new, "launch", "--from-hub", f"file://{old / 'hub'}", "--no-hub",
                       "--gpus", "0", "--max-steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the run stays with the pod that writes it" in done.stdout
    assert worker_records(new, 0, "start")[0]["next_token"] > 0      # resumed, trained
    assert store.head() == head and hub_lease(store, head)["pod_id"] == pod_id(old)
    refused = fractus_pod(new, "launch", "--gpus", "0", "--max-steps", "1")
    assert refused.returncode == 2 and "--no-hub" in refused.stderr, refused.stderr
    assert store.head() == head
