"""Launcher goals of issue 4, measured on this machine.

1. Rollback latency: a tiny CPU pod (2 real workers) at stage 3, FRACTUS_FAULT=nan@30 on
   GPU 1. From the worker's nan event to (a) the launcher's check_failed decision, (b) the
   rolled-back pod's workers started again (`pod_running`), (c) each restarted worker's
   first training step (this one includes model load: python + torch import, model build,
   checkpoint load). Goal: (b) under 10 s; (c) - model load under 10 s.
2. The launcher's own CPU use while supervising 8 workers, measured from the launcher
   process's CPU times only. `--cpu-workers stand-in` (default): 8 stand-in processes that
   write one metrics line per second each (40x the 1B run's rate: a line every 40 steps
   at about 1 step/s) and sleep otherwise, so the 2-core machine is not saturated by
   training; `--cpu-workers tiny`: 8 real tiny CPU workers (contended on 2 cores).
   Goal: under 1% of a core.

    python benchmarks/bench_launcher.py [--cpu-seconds 60] [--cpu-workers stand-in|tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.cli import main as cli_main  # noqa: E402
from launcher.pod.events import read_events  # noqa: E402
from launcher.worker.process import read_records  # noqa: E402

STAND_IN = r'''
import json, os, signal, sys, time
gpu = int(os.environ["GPU_ID"]); out = open(os.environ["METRICS"], "a", buffering=1)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
def put(**r): out.write(json.dumps({"ts": time.time(), "gpu": gpu, **r}) + "\n")
put(type="event", event="start", pid=os.getpid(), next_token=0, step=0)
step = 0
while not stop:
    step += 1
    tf = 6.0 - 0.001 * step
    put(type="metrics", step=step, next_token=step * 128, tf=tf, ema_tf=tf, ss=tf * 1.1,
        ema_ss=tf * 1.1, lb=2.0, grad_norm=0.5, tok_s=1000.0, mem_gb=0.1)
    time.sleep(float(os.environ.get("STAND_IN_PERIOD", "1.0")))
put(type="event", event="done", reason="signal", step=step)
'''


def make_pod(root: Path, devices: str, **overrides) -> Path:
    pod = root / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    from fractus.data import synth
    synth(pod / "data", shards=int(devices.split(":")[1]), tokens=200_000, vocab=512, seed=0)
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config.update({"devices": devices, "env": {"SEQ": "16", "BATCH": "2"}, "save_every": 5,
                   "log_every": 1, "poll_interval_s": 0.5, "stop_grace_s": 20.0}, **overrides)
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    criteria = yaml.safe_load((pod / "manifests" / "trusted_loss.yaml").read_text())
    for name in ("trend", "lb_band", "ss_ratio"):
        criteria["checks"][name].update(interval=5, initialDelay=5)
    criteria["checks"]["trend"].update(lookback=20, tolerance=10.0)
    criteria["checks"]["lb_band"]["band"] = 5.0
    criteria["checks"]["ss_ratio"]["maxRatio"] = 3.0
    (pod / "manifests" / "trusted_loss.yaml").write_text(yaml.safe_dump(criteria))
    return pod


def launch(pod: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                             "launch", *args], cwd=REPO, start_new_session=True,
                            stdout=open(pod / "logs" / "bench_launcher.out", "w"),
                            stderr=subprocess.STDOUT)


def wait_event(pod: Path, kind: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in read_events(pod) if e["event"] == kind]
        if found:
            return found[0]
        time.sleep(0.1)
    raise TimeoutError(kind)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench_rollback(root: Path) -> dict:
    pod = make_pod(root, "cpu:2")
    proc = launch(pod, "--stage", "3", "--fault", "1:nan@30")
    try:
        running = wait_event(pod, "pod_running", 180)
        restart_starts = {e["gpu"]: e["ts"] for e in read_events(pod)
                          if e["event"] == "worker_start" and e["ts"] >= running["ts"] - 60
                          and e.get("stage") == 2}
        first_lines = {}
        deadline = time.monotonic() + 120
        while len(first_lines) < 2 and time.monotonic() < deadline:
            for gpu in (0, 1):
                lines = [r for r in read_records(pod / "logs" / f"metrics_gpu{gpu}.jsonl")
                         if r.get("type") == "metrics" and r["ts"] > running["ts"]]
                starts = [r for r in read_records(pod / "logs" / f"metrics_gpu{gpu}.jsonl")
                          if r.get("event") == "start" and r["ts"] > running["ts"] - 60]
                if lines and starts:
                    first_lines[gpu] = (starts[-1]["ts"], lines[0]["ts"])
            time.sleep(0.2)
    finally:
        stop(proc)
    nan = [r for r in read_records(pod / "logs" / "metrics_gpu1.jsonl")
           if r.get("event") == "nan"][0]
    decided = [e for e in read_events(pod) if e["event"] == "check_failed"][0]
    model_load = {g: first_lines[g][0] - restart_starts[g] for g in first_lines}
    first_step = {g: first_lines[g][1] - nan["ts"] for g in first_lines}
    return {
        "nan_to_decision_s": decided["ts"] - nan["ts"],
        "nan_to_pod_running_s": running["ts"] - nan["ts"],
        "nan_to_first_step_s": first_step,
        "model_load_s": model_load,
        "nan_to_first_step_minus_model_load_s": {g: first_step[g] - model_load[g]
                                                 for g in first_step},
    }


def bench_cpu(root: Path, seconds: float, kind: str) -> dict:
    overrides = {}
    if kind == "stand-in":
        script = root / "stand_in.py"
        script.write_text(STAND_IN)
        overrides = {"worker": ["python", "-u", str(script)]}
    pod = make_pod(root, "cpu:8", **overrides)
    proc = launch(pod, "--stage", "1")
    try:
        wait_event(pod, "launch", 60)
        time.sleep(10)            # past startup: the steady state is what is measured
        launcher = psutil.Process(proc.pid)
        t0, c0 = time.monotonic(), launcher.cpu_times()
        time.sleep(seconds)
        t1, c1 = time.monotonic(), launcher.cpu_times()
        lines = sum(1 for g in range(8)
                    for r in read_records(pod / "logs" / f"metrics_gpu{g}.jsonl")
                    if r.get("type") == "metrics")
    finally:
        stop(proc)
    used = (c1.user - c0.user) + (c1.system - c0.system)
    return {"workers": 8, "kind": kind, "seconds": round(t1 - t0, 1),
            "launcher_cpu_s": round(used, 3),
            "launcher_cpu_pct_of_core": round(100 * used / (t1 - t0), 3),
            "metrics_lines_total": lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-seconds", type=float, default=60.0)
    parser.add_argument("--cpu-workers", choices=("stand-in", "tiny"), default="stand-in")
    parser.add_argument("--skip-rollback", action="store_true")
    parser.add_argument("--skip-cpu", action="store_true")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_rollback:
            (Path(tmp) / "r").mkdir()
            results["rollback"] = bench_rollback(Path(tmp) / "r")
        if not args.skip_cpu:
            (Path(tmp) / "c").mkdir()
            results["cpu"] = bench_cpu(Path(tmp) / "c", args.cpu_seconds, args.cpu_workers)
    print(json.dumps(results, indent=2, default=lambda v: round(v, 3)))


if __name__ == "__main__":
    main()
