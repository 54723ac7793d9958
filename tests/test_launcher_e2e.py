"""End to end: the real launcher supervising real tiny CPU workers (2 processes, 1 thread each).

Each test starts `python -m launcher.cli launch` as a child process, watches the pod's
files (logs/events.jsonl, the workers' metrics files, the manifest), and always kills every
process it started in teardown. Faults come from the worker's own FRACTUS_FAULT injector.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from launcher.pod.ckpt_index import sha256_file
from launcher.cli import main as cli_main
from launcher.pod.events import read_events
from launcher.worker.process import read_records

REPO = Path(__file__).resolve().parents[1]
BATCH, SEQ = 2, 16
TOKENS_PER_STEP = BATCH * SEQ
SHARD_TOKENS = 60_000
# A wait on something that takes seconds on an idle machine but starts processes (a worker's
# torch import and checkpoint load, a launcher's graceful stop): minutes on CI's loaded
# 2-core box. The waits poll for the event, so a generous limit costs nothing when it passes.
PROCESS_S = 300

# Small measurement intervals so checkpoints get verdicts within a few steps; tolerances
# wide enough that a healthy tiny model early in training never trips them.
TEST_CRITERIA = {
    "checks": {
        "finite": {"interval": 0},
        "continuity": {"maxAbsDelta": 5.0},
        "trend": {"interval": 5, "initialDelay": 5, "lookback": 20, "tolerance": 10.0,
                  "failureLimit": 3},
        "lb_band": {"interval": 5, "band": 5.0, "failureLimit": 3},
        "ss_ratio": {"interval": 5, "initialDelay": 5, "maxRatio": 3.0, "failureLimit": 3},
        "loss_spike": {"windowLogs": 10, "factor": 3.0, "patience": 3},
    },
    "supervision": {
        "restarts": {"max_restarts": 3, "window_s": 300, "backoff_s": 0.5, "backoff_max_s": 2},
        "hang": {"timeout_s": 60, "startup_timeout_s": 120},
    },
    # No AR probes unless a test asks (the shipped file probes every checkpoint).
    "probe": {"every": 0},
}


def make_pod(root: Path, criteria: dict | None = None, **config_overrides) -> Path:
    pod = root / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    from fractus.data import synth
    synth(pod / "data", shards=2, tokens=SHARD_TOKENS, vocab=512, seed=0)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["env"].update({"SEQ": str(SEQ), "BATCH": str(BATCH)})
    config.update({"save_every": 5,
                   "log_every": 1, "poll_interval_s": 0.2, "stop_grace_s": 20.0})
    config.update(config_overrides)
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    (pod / "manifests" / "trusted_loss.yaml").write_text(yaml.safe_dump(criteria or TEST_CRITERIA))
    return pod


class Launcher:
    """`fractus-pod launch` in a child process; stop() / teardown kill all it started."""

    running: list["Launcher"] = []   # the test's launchers: a timed-out wait describes them

    def __init__(self, pod: Path, *args: str):
        self.pod = pod
        self.out = open(pod / "logs" / f"test_launcher_{time.time_ns()}.out", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), "launch", *args],
            cwd=REPO, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
        Launcher.running.append(self)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def output(self) -> str:
        self.out.flush()
        self.out.seek(0)
        return self.out.read()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        kill_workers(self.pod)
        self.out.close()
        if self in Launcher.running:
            Launcher.running.remove(self)


def kill_workers(pod: Path) -> None:
    for e in read_events(pod):     # worker_placed: a worker on a Ray node of this machine
        if e.get("event") in ("worker_start", "worker_placed") and e.get("pid"):
            try:
                p = psutil.Process(e["pid"])
                if "fractus.train.worker" in " ".join(p.cmdline()):
                    p.kill()
                    p.wait(10)
            except psutil.Error:
                pass


@pytest.fixture
def launchers():
    started: list[Launcher] = []
    yield started
    for launcher in started:
        launcher.cleanup()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n"
                         + pod_tails({launcher.pod for launcher in Launcher.running}))


def pod_tails(pods, lines: int = 15) -> str:
    """The last lines of what a pod's processes wrote: CI runs once and far away, so a
    timed-out wait must say where things stood. Events, the workers' logs (the pod's own and
    those on Ray nodes' workdirs next to it, `disk-*/`) and the test launcher's output."""
    parts = []
    for pod in sorted(pods):
        logs = pod / "logs"
        for path in [logs / "events.jsonl", *sorted(logs.glob("worker_gpu*.log")),
                     *sorted(pod.parent.glob("disk-*/logs/worker_gpu*.log")),
                     *sorted(logs.glob("test_launcher_*.out"))]:
            try:
                tail = path.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            parts.append(f"--- {path} (last {len(tail)} lines)")
            parts += [line[:400] for line in tail]
    return "\n".join(parts)


def events_of(pod: Path, kind: str, **match) -> list[dict]:
    return [e for e in read_events(pod) if e.get("event") == kind
            and all(e.get(k) == v for k, v in match.items())]


def worker_records(pod: Path, gpu: int, event: str | None = None) -> list[dict]:
    records = read_records(pod / "logs" / f"metrics_gpu{gpu}.jsonl")
    return [r for r in records if event is None or r.get("event") == event]


def manifest_json(pod: Path) -> dict:
    return json.load(open(pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json"))


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
