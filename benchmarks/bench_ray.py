"""Multi-node goals of issue 11, measured on this machine with a real local Ray cluster
(tests/support/ray_cluster.py: a head and 2 nodes, all on 127.0.0.1).

1. Node lost -> its GPU training again on another node: a tiny CPU pod, 2 real workers on
   2 nodes; once GPU 0's node has pushed a passed checkpoint, that node is removed. From
   `remove_node` to (a) the launcher's node_lost event, (b) the worker placed on the other
   node (hub pull included), (c) the worker's start event (its model and checkpoint
   loaded: "model load" is (c) - (b)), (d) its first training step.
   Goal: (d) - model load under 60 s.
2. The launcher's own CPU while supervising 16 workers over 2 nodes (8 "GPUs" each):
   16 stand-in workers writing one metrics line per second each (bench_launcher.py's
   stand-in), side by side in one run with the same 16 on the local backend.
   Goal: under 1 % of a core on the head.
3. The fake-backend supervisor tests (tests/test_supervise_fake*.py), wall time of pytest.
   Goal: under 10 s in total.
4. With `--recovery-point`: what a GPU retrains after its machine is lost at once, in save
   intervals, with `--busy N` busy loops loading the machine: the two-node scenario of
   tests/test_ray_pod.py, which prints a RECOVERY POINT line per loss (the test asserts
   the mechanism; this bound, which a loaded machine's scheduling stretches, is measured
   here). Goal: at most 2 save intervals on a quiet machine.

    python benchmarks/bench_ray.py [--cpu-seconds 60] [--skip-node-loss] [--skip-cpu]
                                   [--recovery-point [--busy N]]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_launcher import REPO, STAND_IN, launch, make_pod, stop  # noqa: E402

sys.path.insert(0, str(REPO))
from launcher.pod.events import read_events  # noqa: E402
from launcher.worker.process import read_records  # noqa: E402
from tests.support.ray_cluster import RESOURCE, local_cluster, node_of  # noqa: E402


def first(pod: Path, kind: str, timeout: float, since: float = 0.0, **match) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in read_events(pod):
            if e["event"] == kind and e["ts"] > since and \
                    all(e.get(k) == v for k, v in match.items()):
                return e
        time.sleep(0.1)
    raise TimeoutError(kind)


def first_record(pod: Path, gpu: int, since: float, timeout: float, **match) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in read_records(pod / "logs" / f"metrics_gpu{gpu}.jsonl"):
            if r.get("ts", 0) > since and all(r.get(k) == v for k, v in match.items()):
                return r
        time.sleep(0.1)
    raise TimeoutError(str(match))


# bench_launcher.make_pod's worker settings, plus the tiny preset's fresh-start permission.
ENV = {"SEQ": "16", "BATCH": "2", "ALLOW_FRESH_START": "1"}


def ray_config(cluster, root: Path) -> dict:
    return {"address": cluster.address, "workdir": str(root / "disk-{node}"),
            "resource": RESOURCE}


def bench_node_loss(root: Path) -> dict:
    with local_cluster(nodes=2, devices_per_node=2) as cluster:
        pod = make_pod(root, "cpu:2", env=ENV, ray=ray_config(cluster, root))
        proc = launch(pod, "--stage", "1")
        try:
            placed = {g: first(pod, "worker_placed", 600, gpu=g) for g in (0, 1)}
            first(pod, "sync_pushed", 600, gpu=0)
            t0 = time.time()
            cluster.remove_node(node_of(cluster, placed[0]["node"]))
            lost = first(pod, "node_lost", 300, since=t0, gpu=0)
            moved = first(pod, "worker_placed", 300, since=t0, gpu=0)
            started = first_record(pod, 0, t0, 300, type="event", event="start")
            stepped = first_record(pod, 0, started["ts"], 300, type="metrics")
        finally:
            stop(proc)
    model_load = started["ts"] - moved["ts"]
    return {"removed_to_node_lost_s": round(lost["ts"] - t0, 2),
            "removed_to_placed_s": round(moved["ts"] - t0, 2),
            "model_load_s": round(model_load, 2),
            "removed_to_first_step_s": round(stepped["ts"] - t0, 2),
            "removed_to_first_step_minus_model_load_s": round(stepped["ts"] - t0 - model_load,
                                                              2),
            "resumed_at_token": started["next_token"], "moved_to_node": moved["node"],
            "lost_node": lost["node"]}


def launcher_cpu(pod: Path, seconds: float, workers: int) -> dict:
    proc = launch(pod, "--stage", "1")
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:       # every worker past startup
            if all(any(r.get("type") == "metrics"
                       for r in read_records(pod / "logs" / f"metrics_gpu{g}.jsonl"))
                   for g in range(workers)):
                break
            time.sleep(1)
        else:
            raise TimeoutError("stand-in workers never all wrote a line")
        time.sleep(10)
        launcher = psutil.Process(proc.pid)
        t0, c0 = time.monotonic(), launcher.cpu_times()
        time.sleep(seconds)
        t1, c1 = time.monotonic(), launcher.cpu_times()
    finally:
        stop(proc)
    used = (c1.user - c0.user) + (c1.system - c0.system)
    return {"workers": workers, "seconds": round(t1 - t0, 1), "launcher_cpu_s": round(used, 3),
            "launcher_cpu_pct_of_core": round(100 * used / (t1 - t0), 3)}


def bench_cpu(root: Path, seconds: float, workers: int = 16) -> dict:
    script = root / "stand_in.py"
    script.write_text(STAND_IN)
    worker = ["python", "-u", str(script)]
    (root / "local").mkdir()
    local_pod = make_pod(root / "local", f"cpu:{workers}", worker=worker, env=ENV)
    local = launcher_cpu(local_pod, seconds, workers)
    with local_cluster(nodes=2, devices_per_node=workers // 2) as cluster:
        (root / "ray").mkdir()
        pod = make_pod(root / "ray", f"cpu:{workers}", worker=worker, env=ENV,
                       ray=ray_config(cluster, root / "ray"))
        ray = launcher_cpu(pod, seconds, workers)
    return {"local": local, "ray_2_nodes": ray,
            "ray_over_local": round(ray["launcher_cpu_s"] / max(local["launcher_cpu_s"], 1e-9),
                                    2)}


def bench_fake_tests() -> dict:
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/test_supervise_fake.py",
                           "tests/test_supervise_fake_nodes.py",
                           "tests/test_supervise_fake_node_pushes.py"],
                          cwd=REPO, capture_output=True, text=True)
    return {"wall_s": round(time.monotonic() - t0, 2),
            "summary": done.stdout.strip().splitlines()[-1]}


def bench_recovery_point(busy: int) -> dict:
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s",
                               "tests/test_ray_pod.py", "-k", "survives_losing_them"],
                              cwd=REPO, capture_output=True, text=True)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    points = [{"loss": m[1], "retrained_tokens": int(m[2].replace(",", "")),
               "save_intervals": float(m[3])}
              for m in re.finditer(r"RECOVERY POINT (.+?): .*retrained ([\d,]+) tokens = "
                                   r"([\d.]+) save intervals", done.stdout)]
    return {"busy_loops": busy, "load_average_after": os.getloadavg(),
            "test": done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "",
            "errors": [line for line in done.stdout.splitlines() if line.startswith("E ")][:5],
            "recovery_points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-seconds", type=float, default=60.0)
    parser.add_argument("--skip-node-loss", action="store_true")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--recovery-point", action="store_true")
    parser.add_argument("--busy", type=int, default=0)
    args = parser.parse_args()
    results = {"fake_backend_tests": bench_fake_tests()}
    if args.recovery_point:
        results["recovery_point"] = bench_recovery_point(args.busy)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_node_loss:
            (Path(tmp) / "n").mkdir()
            results["node_loss"] = bench_node_loss(Path(tmp) / "n")
        if not args.skip_cpu:
            (Path(tmp) / "c").mkdir()
            results["cpu"] = bench_cpu(Path(tmp) / "c", args.cpu_seconds)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
