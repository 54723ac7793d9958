"""End to end: a worker killed (SIGKILL) while a background checkpoint write is in flight.

Real launcher, real tiny CPU workers. The save_hang fault holds GPU 0's step-10 write
mid-file while training goes on; the kill lands during that write. The previous checkpoint
(step 5) stays the file on disk, the manifest keeps pointing at it (no event ever named the
unfinished file), and the restarted worker resumes from it exactly.
"""

import os
import signal
from pathlib import Path

from launcher.files import sha256_file
from tests.support.e2e import (TOKENS_PER_STEP, Launcher, events_of, launchers, make_pod,
                               manifest_json, wait_for, worker_records)

__all__ = ["launchers"]   # the fixture, imported for pytest


def test_kill_9_during_a_background_write_keeps_the_previous_checkpoint_and_manifest(
        tmp_path, launchers):
    pod = make_pod(tmp_path)
    launcher = Launcher(pod, "--stage", "1", "--fault", "0:save_hang@10")
    launchers.append(launcher)
    canonical = pod / "checkpoints" / "fractus_1b_gpu0.pt"

    def writing_step_10():
        steps = [r["step"] for r in worker_records(pod, 0) if r.get("type") == "metrics"]
        temps = [p for p in canonical.parent.glob(f".{canonical.name}.tmp.*")
                 if p.stat().st_size > 0]
        return steps and max(steps) >= 12 and temps    # training went on past the save

    def recorded_step_5():
        # The launcher reads the step-5 event on its own poll: under load that can come
        # after the worker reached step 12 (CI once read the manifest before it had).
        path = pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json"
        return path.is_file() and "gpu_0" in manifest_json(pod)

    wait_for(lambda: writing_step_10() and recorded_step_5(), 120,
             "GPU 0 training on while its step-10 write hangs, its step 5 in the manifest")
    manifest = manifest_json(pod)["gpu_0"]
    os.kill(events_of(pod, "worker_start", gpu=0)[-1]["pid"], signal.SIGKILL)

    saved = worker_records(pod, 0, "checkpoint")
    assert [c["step"] for c in saved] == [5]          # no event for the unfinished write
    assert manifest["start_token"] == 5 * TOKENS_PER_STEP
    assert manifest["checkpoint_sha256"] == saved[0]["sha256"]
    assert sha256_file(pod / manifest["checkpoint"]) == saved[0]["sha256"]   # intact on disk
    assert manifest_json(pod)["gpu_0"]["start_token"] == 5 * TOKENS_PER_STEP

    wait_for(lambda: len(worker_records(pod, 0, "start")) == 2, 90, "the restarted worker")
    (crash,) = events_of(pod, "worker_crash", gpu=0)
    assert "-9" in crash["reason"]
    restart = events_of(pod, "worker_start", gpu=0)[-1]
    assert restart["start_token"] == 5 * TOKENS_PER_STEP and not restart["fault"]
    resumed = worker_records(pod, 0, "start")[-1]
    assert resumed["resume"] == "full" and resumed["next_token"] == 5 * TOKENS_PER_STEP
    os.killpg(launcher.proc.pid, signal.SIGTERM)
    assert launcher.wait(90) == 0, launcher.output()
    assert not [p for p in Path(canonical.parent).glob(f".{canonical.name}.tmp.*")]
