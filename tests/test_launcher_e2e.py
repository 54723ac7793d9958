"""End to end: the real launcher supervising real tiny CPU workers (2 processes, 1 thread each).

Each test starts `python -m launcher.cli launch` as a child process, watches the pod's
files (logs/events.jsonl, the workers' metrics files, the manifest), and always kills every
process it started in teardown. Faults come from the worker's own FRACTUS_FAULT injector.
"""

from __future__ import annotations

import os
import signal

from launcher.files import sha256_file
from tests.support.e2e import (BATCH, TOKENS_PER_STEP, Launcher, events_of,  # noqa: F401
                               launchers, make_pod, manifest_json, wait_for, worker_records)


def test_launch_trains_and_manifest_advances(tmp_path, launchers):
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "1", "--max-steps", "12")
    launchers.append(launcher)
    assert launcher.wait(120) == 0, launcher.output()
    assert events_of(pod, "pod_done")
    manifest = manifest_json(pod)
    for gpu in (0, 1):
        entry = manifest[f"gpu_{gpu}"]
        assert entry["start_token"] == 12 * TOKENS_PER_STEP     # the user's one-liner works
        assert entry["stage"] == 1
        assert sha256_file(pod / entry["checkpoint"]) == entry["checkpoint_sha256"]
        tokens = [c["next_token"] for c in worker_records(pod, gpu, "checkpoint")]
        assert tokens == sorted(tokens) and tokens[-1] == entry["start_token"]
        start = worker_records(pod, gpu, "start")[-1]
        assert start["settings"]["ce_chunk"] == 0 and start["settings"]["batch"] == BATCH
    # TensorBoard: one run per GPU (its stage as a scalar), the launcher's decisions as text.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    for gpu in (0, 1):
        run = EventAccumulator(str(pod / "logs" / "tb" / f"gpu{gpu}"))
        run.Reload()
        assert [p.step for p in run.Scalars("loss/ema_tf")][-1] == 12
        assert {p.value for p in run.Scalars("stage")} == {1.0}
    decisions = EventAccumulator(str(pod / "logs" / "tb" / "launcher"))
    decisions.Reload()
    assert {"events/launch/text_summary", "events/pod_done/text_summary"} <= set(
        decisions.Tags()["tensors"])


def test_nan_on_one_gpu_rolls_it_back_and_the_pod_to_previous_stage(tmp_path, launchers):
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "3", "--fault", "1:nan@30")
    launchers.append(launcher)
    wait_for(lambda: events_of(pod, "pod_running", after="rollback"), 120, "the rolled-back pod")
    (rollback,) = events_of(pod, "rollback")
    assert rollback["gpu"] == 1 and rollback["from_stage"] == 3 and rollback["to_stage"] == 2
    # The newest checkpoint before the NaN (step 25) was verified by the checks at step 26.
    assert rollback["to_token"] == 25 * TOKENS_PER_STEP
    assert rollback["from_token"] >= rollback["to_token"]
    restarted_at = rollback["ts"]

    # GPU 1 trains again at stage 2 from the restored checkpoint; GPU 0 kept its progress.
    wait_for(lambda: [c for c in worker_records(pod, 1, "checkpoint") if c["ts"] > restarted_at],
             90, "a stage-2 checkpoint on GPU 1")
    wait_for(lambda: [s for s in worker_records(pod, 0, "start") if s["ts"] > restarted_at],
             90, "GPU 0 restarted at stage 2")
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(60) == 0, launcher.output()

    starts1 = worker_records(pod, 1, "start")
    assert starts1[-1]["next_token"] == 25 * TOKENS_PER_STEP
    assert starts1[-1]["settings"]["attn_impl"] == "cumsum"       # stage 2 settings
    assert starts1[0]["settings"]["attn_impl"] == "chunked"       # stage 3 settings
    gpu0_ckpts_before = [c for c in worker_records(pod, 0, "checkpoint") if c["ts"] < restarted_at]
    starts0 = worker_records(pod, 0, "start")
    kept = gpu0_ckpts_before[-1]["next_token"] if gpu0_ckpts_before else 0
    assert starts0[-1]["next_token"] == kept
    assert not events_of(pod, "rollback", gpu=0)
    manifest = manifest_json(pod)
    assert manifest["gpu_1"]["stage"] == 2 and manifest["gpu_0"]["stage"] == 2
    assert manifest["gpu_1"]["start_token"] > rollback["to_token"]
    nan = worker_records(pod, 1, "nan")
    assert nan and nan[0]["step"] == 30
