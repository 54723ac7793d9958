"""The worker with background checkpoint writes (ASYNC_SAVE=1, the default): a second
signal during a write in flight. (Exact resume after a real SIGTERM with background writes:
tests/test_worker_resume.py.)

A real worker subprocess and signals; the save_hang fault holds one background write
mid-file (its temp file has bytes, nothing is renamed) for as long as the test needs."""

import signal
from pathlib import Path

from launcher.files import sha256_file
from tests.support.e2e import wait_for
from tests.support.worker_utils import (events, metrics_lines, read_jsonl, run_worker,
                                        start_worker, wait_for_line, worker_env,
                                        write_synth_shard)


def temp_files(ckpt_out: str) -> list[Path]:
    out = Path(ckpt_out)
    return [p for p in out.parent.glob(f".{out.name}.tmp.*") if p.stat().st_size > 0]


def test_second_signal_during_a_background_write_exits_at_once_keeping_the_previous_file(
        tmp_path):
    shard = write_synth_shard(tmp_path / "shard.npy", tokens=4000)
    env = worker_env(tmp_path, SHARD=shard, SAVE_EVERY=2, FRACTUS_FAULT="save_hang@4")
    child = start_worker(env)
    # training goes on past step 4 while its checkpoint's write hangs mid-file
    wait_for(lambda: [m for m in metrics_lines(read_jsonl(env["METRICS"])) if m["step"] >= 5],
             90, "step 5")
    assert temp_files(env["CKPT_OUT"])
    (previous,) = events(read_jsonl(env["METRICS"]), "checkpoint")
    assert previous["step"] == 2 and sha256_file(env["CKPT_OUT"]) == previous["sha256"]

    child.send_signal(signal.SIGTERM)
    wait_for_line(child, "SIGTERM: finishing the step")     # taken: the first signal only asks
    child.send_signal(signal.SIGTERM)
    # 143, not 0: the worker was still waiting for the write in flight when the second
    # signal came (the first one's graceful stop would have exited 0).
    assert child.wait(timeout=10) == 128 + signal.SIGTERM
    assert not events(read_jsonl(env["METRICS"]), "done")      # it never went on to the end
    assert [c["step"] for c in events(read_jsonl(env["METRICS"]), "checkpoint")] == [2]
    assert sha256_file(env["CKPT_OUT"]) == previous["sha256"]

    resumed = {k: v for k, v in env.items() if k != "FRACTUS_FAULT"}
    proc = run_worker({**resumed, "MAX_STEPS": "1"})
    assert proc.returncode == 0, proc.stderr
    start = events(read_jsonl(env["METRICS"]), "start")[-1]
    assert start["resume"] == "full" and start["next_token"] == previous["next_token"]
    assert not temp_files(env["CKPT_OUT"])   # the dead write's temp file was removed
