"""End to end, a restart never wedges (issue 10, items 1 and 4): a worker SIGKILLed between
renaming its checkpoint into place and reporting it, or a checkpoint damaged mid-run, is
resumed from the exact bytes the manifest names (sha256-verified local copy), at once and at
every later launch.

Uses the pod helpers of tests/support/e2e.py (real launcher, real tiny CPU workers).
"""

from __future__ import annotations

import os
import signal

import yaml

from launcher.files import sha256_file
from tests.support.e2e import (TEST_CRITERIA, TOKENS_PER_STEP, Launcher, events_of,
                               launchers, make_pod, manifest_json, wait_for,
                               worker_records)

__all__ = ["launchers"]   # the fixture, imported for pytest

CANONICAL = "checkpoints/fractus_1b_gpu0.pt"


def replace_file(path, data: bytes) -> None:
    """New bytes under the name (a new inode, as a copy or an editor would leave it)."""
    tmp = path.with_name(path.name + ".replacing")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def worker_starts(pod, gpu):
    return worker_records(pod, gpu, "start")


def test_worker_killed_between_rename_and_event_resumes_the_manifest_bytes(tmp_path, launchers):
    pod = make_pod(tmp_path)
    # GPU 0 saves at step 5 (reported), then at step 10 renames its checkpoint into place
    # and is SIGKILLed before the event: the file is newer than the manifest knows.
    first = Launcher(pod, "--stage", "1", "--max-steps", "12", "--fault", "0:kill_after_save@10")
    launchers.append(first)
    assert first.wait(300) == 0, first.output()
    exits = [e["code"] for e in events_of(pod, "worker_exit", gpu=0)]
    assert exits[0] == -9
    (recovered,) = events_of(pod, "checkpoint_recovered", gpu=0)
    assert recovered["was"] == CANONICAL
    assert recovered["checkpoint"].startswith("checkpoints/retained/gpu0/token")
    starts = worker_starts(pod, 0)
    assert [s["next_token"] for s in starts] == [0, 5 * TOKENS_PER_STEP]
    assert starts[1]["source"] == recovered["checkpoint"]
    # 5 steps kept, then the restart's 12: no token skipped, none trained twice.
    assert manifest_json(pod)["gpu_0"]["start_token"] == 17 * TOKENS_PER_STEP
    assert not events_of(pod, "pod_failed")

    # At the next launch: the named file replaced by other bytes -> the retained copy.
    entry = manifest_json(pod)["gpu_0"]
    named = pod / entry["checkpoint"]
    replace_file(named, b"damaged" * 1000)
    second = Launcher(pod, "--stage", "1", "--max-steps", "1")
    launchers.append(second)
    assert second.wait(300) == 0, second.output()
    earlier, recovered = events_of(pod, "checkpoint_recovered", gpu=0)
    assert recovered["was"] == entry["checkpoint"]
    assert sha256_file(pod / recovered["checkpoint"]) == entry["checkpoint_sha256"]
    assert worker_starts(pod, 0)[-1]["next_token"] == entry["start_token"]
    assert manifest_json(pod)["gpu_0"]["start_token"] == entry["start_token"] + TOKENS_PER_STEP


def test_checkpoint_damaged_mid_run_is_recovered_at_the_restart(tmp_path, launchers):
    pod = make_pod(tmp_path)
    first = Launcher(pod, "--stage", "1", "--max-steps", "3")
    launchers.append(first)
    assert first.wait(300) == 0, first.output()
    entry = manifest_json(pod)["gpu_0"]
    # No periodic save in the second run: the manifest keeps naming the same file.
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["save_every"] = 100_000
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    second = Launcher(pod, "--stage", "1")
    launchers.append(second)
    wait_for(lambda: len(worker_records(pod, 0, "start")) == 2
             and worker_records(pod, 0)[-1].get("type") == "metrics", 120,
             "GPU 0 training again")
    replace_file(pod / entry["checkpoint"], b"\0" * 4096)       # damaged under the worker
    os.kill(events_of(pod, "worker_start", gpu=0)[-1]["pid"], signal.SIGKILL)
    wait_for(lambda: len(worker_starts(pod, 0)) == 3, 120, "GPU 0 restarted")
    (recovered,) = events_of(pod, "checkpoint_recovered", gpu=0)
    assert sha256_file(pod / recovered["checkpoint"]) == entry["checkpoint_sha256"]
    assert worker_starts(pod, 0)[-1]["next_token"] == entry["start_token"]
    os.killpg(second.proc.pid, signal.SIGTERM)
    assert second.wait(120) == 0, second.output()
    assert not events_of(pod, "pod_failed")


def test_newest_checkpoint_damaged_in_place_status_says_the_hub_lacks_it_and_launch_restores(
        tmp_path, capsys):
    """Issue 16 item 27. Seen: the newest checkpoint is never on the hub (only passed ones
    are pushed), so the hub cannot rescue damage to it; its retained link shares its inode,
    so damage in place reaches that too. Status says the hub does not hold it and which
    token the hub holds. Issue 25 item 22: the launch no longer refuses with the
    `rollback --gpu` command to type; it restores the newest passed checkpoint by itself."""
    import re

    from launcher.cli import main as cli_main
    from launcher.config.podconfig import load_pod_config
    from launcher.dashboard.status import collect
    pod = make_pod(tmp_path)
    args = ["--pod-dir", str(pod), "launch", "--stage", "1", "--gpus", "0"]
    assert cli_main([*args, "--max-steps", "12"]) == 0, capsys.readouterr()
    pushed = manifest_json(pod)["gpu_0"]
    assert pushed.get("hub_revision")           # a clean end pushes what passed
    # The next run's checks vouch for nothing before step 100: its checkpoints stay
    # unjudged, as the newest one mostly is mid-run, and only passed ones are pushed.
    criteria = pod / "manifests" / "trusted_loss.yaml"
    slow = {**TEST_CRITERIA, "checks": {name: {**spec, "interval": 100, "initialDelay": 100}
                                         if spec.get("interval") else spec
                                         for name, spec in TEST_CRITERIA["checks"].items()}}
    criteria.write_text(yaml.safe_dump(slow))
    assert cli_main([*args, "--max-steps", "7"]) == 0, capsys.readouterr()
    criteria.write_text(yaml.safe_dump(TEST_CRITERIA))
    entry = manifest_json(pod)["gpu_0"]
    assert not entry.get("hub_revision") and entry["start_token"] > pushed["start_token"]
    with open(pod / entry["checkpoint"], "r+b") as f:      # damage in place: same inode
        f.seek(200)
        f.write(b"\0" * 64)
    (row,) = collect(pod, load_pod_config(pod))["gpus"][:1]
    held = row["hub_note"]
    assert "newest checkpoint" in held and "not on the hub" in held, row
    assert re.search(r"hub holds token [\d,]+", held), held
    assert cli_main([*args, "--max-steps", "1"]) == 0, capsys.readouterr()
    (rolled,) = events_of(pod, "rollback", gpu=0)
    assert (rolled["from_token"], rolled["to_token"]) == (entry["start_token"],
                                                          pushed["start_token"])
    assert rolled["lost"] == entry["checkpoint"]
    start = events_of(pod, "worker_start", gpu=0)[-1]
    assert start["start_token"] == pushed["start_token"]
