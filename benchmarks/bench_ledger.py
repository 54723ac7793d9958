"""Issue 19's ledger goal: the goodput ledger of a 1000-event run computed in under 100 ms.

A synthetic pod of 8 GPUs written in the launcher's and the workers' exact formats: launcher
sessions with canaries, per GPU a metrics line every 20 s, a checkpoint (with its stall)
every 10 lines, and incidents drawn with a fixed seed (kill -9 and restart, hang, rollback,
node loss) until the event log holds --events records. Timed (median of --repeats, after a
warm-up):

  compute   compute_ledger over the records in memory (the sweep alone)
  from files pod_ledger(pod_dir): reading logs/events.jsonl and every METRICS file, then the
             sweep, as `status`, `report` and the dashboard do on every call

--per-session sets the metrics lines per GPU and session (the event count stays --events):
more shows how the on-demand cost grows with a long run's files. Wall and CPU time (this
process's) are both printed: on a shared, loaded machine the wall time is mostly waiting.

    python benchmarks/bench_ledger.py [--events 1000] [--per-session 300] [--gpus 8] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.dashboard.goodput import compute_ledger  # noqa: E402
from launcher.dashboard.goodput_files import pod_ledger  # noqa: E402
from launcher.paths import EVENTS_FILE, metrics_path  # noqa: E402

LINE_S, TOKENS_PER_LINE = 20.0, 40 * 8 * 2048


def synthetic_run(events_wanted: int, per_session: int, gpus: int, seed: int = 0):
    """(events, GPU -> METRICS records): sessions of `per_session` lines per GPU."""
    rng = random.Random(seed)
    events: list[dict] = []
    metrics: dict[int, list[dict]] = {g: [] for g in range(gpus)}
    token = dict.fromkeys(range(gpus), 0)
    t = 1.8e9
    while len(events) < events_wanted:
        events.append({"ts": t, "event": "canary", "seconds": 120.0, "passed": True})
        t += 130
        events.append({"ts": t, "event": "launch", "stage": 3, "gpus": list(range(gpus))})
        for g in range(gpus):
            events.append({"ts": t + 0.1, "event": "worker_start", "gpu": g,
                           "start_token": token[g]})
        for i in range(per_session):
            now = t + 60 + i * LINE_S
            for g in range(gpus):
                token[g] += TOKENS_PER_LINE
                metrics[g].append({"type": "metrics", "ts": now + g * 0.01, "gpu": g,
                                   "step": token[g] // 16384, "next_token": token[g],
                                   "tf": 3.2, "ema_tf": 3.2, "tok_s": 9000.0})
                if i % 10 == 9:
                    metrics[g].append({"type": "event", "event": "checkpoint", "gpu": g,
                                       "ts": now + 1, "next_token": token[g],
                                       "stall_s": 0.4})
            if rng.random() < 0.15:
                g = rng.randrange(gpus)
                kind = rng.choice(["crash", "hang", "rollback", "node"])
                back = 5 * TOKENS_PER_LINE
                if kind == "crash":
                    events += [{"ts": now + 5, "event": "worker_exit", "gpu": g, "code": -9},
                               {"ts": now + 5, "event": "worker_crash", "gpu": g}]
                elif kind == "hang":
                    events += [{"ts": now + 5, "event": "hang", "gpu": g, "silent_s": 600},
                               {"ts": now + 5, "event": "worker_crash", "gpu": g}]
                elif kind == "rollback":
                    events += [{"ts": now + 5, "event": "check_failed", "gpu": g},
                               {"ts": now + 5, "event": "worker_exit", "gpu": g, "code": -9},
                               {"ts": now + 6, "event": "rollback", "gpu": g}]
                else:
                    events += [{"ts": now + 5, "event": "node_lost", "gpu": g},
                               {"ts": now + 5, "event": "gpu_waiting", "gpu": g}]
                token[g] = max(0, token[g] - back)
                events.append({"ts": now + 8, "event": "worker_start", "gpu": g,
                               "start_token": token[g]})
            if len(events) >= events_wanted - 1:
                break
        t += 60 + per_session * LINE_S
        events.append({"ts": t, "event": "pod_stopped", "reason": "SIGTERM received"})
        t += 600
    return events[:events_wanted], metrics


def write_pod(root: Path, events: list[dict], metrics: dict[int, list[dict]]) -> Path:
    pod = root / "pod"
    (pod / "logs").mkdir(parents=True)
    (pod / EVENTS_FILE).write_text("".join(json.dumps(e) + "\n" for e in events))
    for g, records in metrics.items():
        (pod / metrics_path(g)).write_text("".join(json.dumps(r) + "\n" for r in records))
    return pod


def median_ms(fn, repeats: int) -> tuple[float, float]:
    """(median wall ms, median CPU ms of this process)."""
    fn()                                   # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1000)
    parser.add_argument("--per-session", type=int, default=300,
                        help="metrics lines per GPU and launcher session")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    events, metrics = synthetic_run(args.events, args.per_session, args.gpus)
    with tempfile.TemporaryDirectory() as tmp:
        pod = write_pod(Path(tmp), events, metrics)
        load = os.getloadavg()[0]
        compute = median_ms(lambda: compute_ledger(events, metrics), args.repeats)
        files = median_ms(lambda: pod_ledger(pod), args.repeats)
        ledger = pod_ledger(pod).to_dict()
    records = sum(len(r) for r in metrics.values())
    print(f"{len(events)} events, {args.gpus} GPUs x {records // args.gpus} metrics records, "
          f"{ledger['sessions']} sessions, goodput {ledger['goodput']}")
    print("| | wall | CPU |\n|---|---|---|")
    for name, (wall, cpu) in (("compute", compute), ("from files", files)):
        print(f"| {name} | {wall:.1f} ms | {cpu:.1f} ms |")
    print(f"load average (1 min) at the start: {load:.1f} on {os.cpu_count()} cores; "
          f"goal: under 100 ms")


if __name__ == "__main__":
    main()
