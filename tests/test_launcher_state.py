"""Pod files without a running launcher: checkpoint verdicts, the lock, events, status,
rollback by hand, and the CLI's handling of bad arguments."""

import json
import os
import subprocess
import sys
import time

import pytest

from launcher.pod.ckpt_index import FAILED, PASSED, PENDING, CheckpointIndex
from launcher.cli import main as cli_main
from launcher.errors import PodBusy
from launcher.pod.events import EventLog, read_events
from launcher.pod.lock import PodLock, read_holder
from launcher.pod.setup_init import init_pod
from tests.support.pod_history import fake_checkpoint, pod_with_history, supervisor_for


def test_index_retains_each_checkpoint_and_restores_the_newest_passed(tmp_path):
    index = CheckpointIndex(tmp_path)
    first = fake_checkpoint(tmp_path, 0, b"good weights", 640, 10)
    index.add(0, first, 3, "checkpoints/fractus_1b_gpu0.pt")
    second = fake_checkpoint(tmp_path, 0, b"bad weights!", 1280, 20)   # replaces the file
    index.add(0, second, 3, "checkpoints/fractus_1b_gpu0.pt")
    assert [r["verdict"] for r in index.for_gpu(0)] == [PENDING, PENDING]
    assert index.newest_passed(0) is None
    index.mark(0, first["sha256"], PASSED, "checks passed")
    index.mark(0, second["sha256"], FAILED, "nan")
    target = index.newest_passed(0)
    # The canonical file now holds the bad bytes; the retained link kept the good ones.
    assert target["next_token"] == 640
    assert (tmp_path / target["path"]).read_bytes() == b"good weights"
    reloaded = CheckpointIndex(tmp_path)                  # verdicts survive a restart
    assert reloaded.newest_passed(0)["sha256"] == first["sha256"]
    assert [r["verdict"] for r in reloaded.for_gpu(0)] == [PASSED, FAILED]


def test_index_refuses_a_retained_file_whose_bytes_changed(tmp_path):
    index = CheckpointIndex(tmp_path)
    event = fake_checkpoint(tmp_path, 1, b"v1", 64, 1)
    record = index.add(1, event, 1, "checkpoints/fractus_1b_gpu1.pt")
    index.mark(1, event["sha256"], PASSED, "ok")
    (tmp_path / record["retained"]).unlink()
    (tmp_path / "checkpoints" / "fractus_1b_gpu1.pt").write_bytes(b"v2")   # different bytes
    assert index.newest_passed(1) is None


def test_lock_is_exclusive_and_released_when_the_holder_dies(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from pathlib import Path;"
                               "from launcher.pod.lock import PodLock;"
                               "PodLock(Path(sys.argv[1])).acquire(); print('held', flush=True);"
                               "time.sleep(60)", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert read_holder(tmp_path)["pid"] == holder.pid
        with pytest.raises(PodBusy, match=f"pid {holder.pid}"):
            PodLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert read_holder(tmp_path) is None             # SIGKILL released it: no stale lock
    with PodLock(tmp_path):
        assert read_holder(tmp_path)["pid"] == os.getpid()


def test_events_append_and_tail(tmp_path):
    log = EventLog(tmp_path)
    for i in range(5):
        log.emit("tick", i=i)
    with open(log.path, "a") as f:
        f.write('{"partial": ')                          # a line being written
    assert [e["i"] for e in read_events(tmp_path, last=2)] == [3, 4]


def test_rollback_by_hand_without_a_launcher(tmp_path, capsys):
    pod = pod_with_history(tmp_path)
    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "2", "--gpu", "0"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0: restored token 640" in out
    data = json.load(open(pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json"))
    assert data["gpu_0"]["start_token"] == 640 and data["gpu_0"]["stage"] == 2
    assert data["gpu_1"]["start_token"] == 960 and data["gpu_1"]["stage"] == 2   # kept
    (event,) = [e for e in read_events(pod) if e["event"] == "rollback"]
    assert event["from_token"] == 1280 and event["to_token"] == 640 and not event["automatic"]
    assert [r["verdict"] for r in CheckpointIndex(pod).for_gpu(0)] == [PASSED, FAILED]


def test_rollback_by_hand_refuses_a_gpu_without_passed_checkpoint(tmp_path, capsys):
    pod = pod_with_history(tmp_path)
    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "2", "--gpu", "1"]) == 2
    assert "no passed checkpoint" in capsys.readouterr().err
    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "9"]) == 2


def test_status_reads_files_only(tmp_path, capsys):
    pod = pod_with_history(tmp_path)
    from fractus.data import synth
    synth(pod / "data", shards=2, tokens=12_800, vocab=512, seed=0)
    metrics = {"type": "metrics", "ts": time.time(), "gpu": 1, "step": 15, "next_token": 960,
               "tf": 5.1, "ema_tf": 5.2, "ss": None, "ema_ss": 5.6, "lb": 2.2,
               "grad_norm": 0.4, "tok_s": 812.0, "mem_gb": 0.3}
    (pod / "logs" / "metrics_gpu1.jsonl").write_text(json.dumps(metrics) + "\n{\"type\": \"met")
    assert cli_main(["--pod-dir", str(pod), "status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pod_state"] == "not running" and report["launcher_pid"] is None
    gpu0, gpu1 = report["gpus"]
    assert gpu0["next_token"] == 1280 and gpu0["shard_pct"] == pytest.approx(10.0)
    assert gpu1["ema_ss"] == 5.6 and gpu1["tok_s"] == 812.0 and gpu1["next_token"] == 960
    assert gpu0["checkpoint_age_s"] is not None and gpu0["checkpoint_age_s"] >= 0
    assert cli_main(["--pod-dir", str(pod), "status"]) == 0
    table = capsys.readouterr().out
    assert "not running" in table and "1,280" in table and "812" in table


@pytest.mark.parametrize("args, words", [
    (["launch", "--stage", "7"], "unknown stage 7"),
    (["launch", "--stage", "1", "--fault", "nan@3"], "--fault expects"),
    (["launch", "--stage", "1", "--fault", "5:nan@3"], "does not run"),
    (["launch", "--stage", "1", "--devices", "cpu:0"], "cpu:N"),
    (["launch", "--stage", "1", "--gpus", "4"], "not in devices"),
    (["launch", "--stage", "1", "--max-time", "0"], "--max-time"),
])
def test_launch_argument_mistakes_exit_2_before_anything_starts(tmp_path, capsys, args, words):
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    assert cli_main(["--pod-dir", str(pod), *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1
    assert not read_events(pod)


def test_stop_without_a_launcher_says_so(tmp_path, capsys):
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    assert cli_main(["--pod-dir", str(pod), "stop"]) == 0
    assert "no launcher is running" in capsys.readouterr().out


def test_sync_push_sends_only_passed_checkpoints_and_launch_restores_from_hub(tmp_path, capsys,
                                                                            monkeypatch):
    pod = pod_with_history(tmp_path)
    assert cli_main(["--pod-dir", str(pod), "sync", "push", "-m", "test"]) == 0
    revision = capsys.readouterr().out.split("pushed revision ")[1].split()[0]
    assert cli_main(["--pod-dir", str(pod), "sync", "history"]) == 0
    assert revision[:12] in capsys.readouterr().out

    other = tmp_path / "other"
    init_pod(other, "tiny-cpu")
    config = (other / "fractus-pod.yaml").read_text()
    (other / "fractus-pod.yaml").write_text(config.replace("file://hub", f"file://{pod / 'hub'}"))
    assert cli_main(["--pod-dir", str(other), "sync", "pull"]) == 0
    pulled = json.load(open(other / "checkpoints" / "RESUME_MANIFEST_8GPU.json"))
    # GPU 0's newest *passed* checkpoint went up (640), not the pending one (1280);
    # GPU 1 has no passed checkpoint, so it is not on the hub at all.
    assert pulled["gpu_0"]["start_token"] == 640 and "gpu_1" not in pulled
    assert (other / "checkpoints" / "fractus_1b_gpu0.pt").read_bytes() == b"good"

    # A launch where the manifest's checkpoint is gone pulls it from its pinned revision.
    pulled["gpu_0"]["hub_revision"] = revision
    (other / "checkpoints" / "RESUME_MANIFEST_8GPU.json").write_text(json.dumps(pulled))
    (other / "checkpoints" / "fractus_1b_gpu0.pt").unlink()
    from launcher.supervise.plan import load_plan
    from launcher.supervise.custodian import CheckpointCustodian
    plan, manifest = load_plan(other, 1, "cpu:1", None)

    def restore_from_hub(plan, manifest, events):
        CheckpointCustodian.for_plan(plan, manifest, events).recover()
    restore_from_hub(plan, manifest, EventLog(other))
    assert (other / "checkpoints" / "fractus_1b_gpu0.pt").read_bytes() == b"good"
    assert [e["revision"] for e in read_events(other) if e["event"] == "checkpoint_pulled"] \
        == [revision]
    # Intact bytes stay; same-size bytes that fail their sha256 are pulled again.
    restore_from_hub(plan, manifest, EventLog(other))
    (other / "checkpoints" / "fractus_1b_gpu0.pt").write_bytes(b"bad!")
    restore_from_hub(plan, manifest, EventLog(other))
    assert (other / "checkpoints" / "fractus_1b_gpu0.pt").read_bytes() == b"good"
    assert len([e for e in read_events(other) if e["event"] == "checkpoint_pulled"]) == 2
    # The hashing shows its progress (every line here; by default only past 5 s).
    import launcher.pod.progress
    monkeypatch.setattr(launcher.pod.progress, "PLAIN_FIRST_S", 0.0)
    capsys.readouterr()
    restore_from_hub(plan, manifest, EventLog(other))
    out = capsys.readouterr().out
    assert "hashing 1 checkpoint(s): 0.0 MB/0.0 MB (100%), done in" in out


@pytest.mark.parametrize("stage, rolled_back, words", [
    (1, False, "stage 1 failed: there is no stage below it"),
    (3, True, "stage 3 failed after a rollback: not looping"),
])
def test_rollback_never_goes_below_stage_1_and_never_loops(tmp_path, stage, rolled_back, words):
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    sup = supervisor_for(pod, stage)
    sup.pod.rolled_back = rolled_back
    run = sup.pod.runs[1]
    from launcher.checks.health import GpuHealth
    run.health = GpuHealth(sup.pod.plan.criteria, 10)
    run.health.fail("finite", "nan event at step 7")
    sup.rollback.roll_back([run], auto=True)
    assert sup.pod.state == "failed" and sup.pod.exit_code == 1
    (failed,) = [e for e in read_events(pod) if e["event"] == "pod_failed"]
    assert words in failed["reason"] and "nan event at step 7" in failed["reason"]
    assert not [e for e in read_events(pod) if e["event"] in ("rollback", "worker_start")]


def test_a_write_error_after_logs_moved_names_the_moved_logs_folder(tmp_path):
    """CI saw it: when `mv logs logs.moved` lands between the loop's logs/ check and the
    launcher's next read, the read's FileNotFoundError reached the pod's reason as "a pod file
    went away" with the file's path; the user's fix is the same either way, but the one line
    must name what happened: logs/ itself moved."""
    from launcher.files import dir_id
    pod = tmp_path / "pod"
    init_pod(pod, "tiny-cpu")
    sup = supervisor_for(pod, 1)
    sup.pod.logs_id = dir_id(pod / "logs")
    (pod / "logs").rename(pod / "logs.moved")
    try:
        (pod / "logs" / "checkpoints.jsonl").read_text()
    except FileNotFoundError as exc:
        sup.ending.on_write_error(exc)
    assert sup.pod.state == "failed" and sup.pod.exit_code == 1
    assert sup.pod.reason.startswith("logs/ was moved, replaced or deleted"), sup.pod.reason
    assert not (pod / "logs").exists()
