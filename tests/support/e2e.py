"""The real launcher supervising real tiny CPU workers, for end-to-end tests: a pod made for
them, `fractus-pod launch` as a child process (killed with its workers in teardown by the
`launchers` fixture), and readers of what the pod's processes recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from launcher.cli import main as cli_main
from launcher.pod.events import read_events
from launcher.worker.process import read_records

REPO = Path(__file__).resolve().parents[2]
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
