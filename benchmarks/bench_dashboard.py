"""Issue 12's goals, measured on this machine.

1. Page ready: a pod of 8 GPUs x 100k metrics lines each (synthetic lines in the worker's
   exact format, a restart and markers in the events); `fractus-pod dashboard` serving it;
   Debian's headless chromium (selenium + chromedriver) loads the page. Page ready = the
   page's own performance.now() when its first data is drawn (navigation start -> 3 charts
   of 8 curves, table and markers on screen). Measured cold (the server's first answer
   parses all 800k lines) and warm (a new page on a server that has read them).
   Goal: under 1 s.
2. Idle: the dashboard server's own CPU time (psutil, its process only) over
   --idle-seconds while the page stays open and polls every 2 s on an unchanging pod; and
   with no page open. Goal: under 1 % of a core.
3. TensorBoard cost in the worker: (a) the cost of one metrics line with and without the
   TensorBoard mirror (MetricsWriter, 2000 lines each, same process, interleaved);
   (b) real tiny CPU workers run side by side with and without TB_DIR, a metrics line
   every step (LOG_EVERY=1, 40x the production rate), median step interval from the lines'
   timestamps. Goal: TensorBoard writing adds under 1 % to the worker's step time.

    python benchmarks/bench_dashboard.py [--lines 100000] [--gpus 8] [--idle-seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.dashboard import DashboardProcess  # noqa: E402
from tests.support.worker_utils import (read_jsonl, start_worker, worker_env,  # noqa: E402
                                        write_synth_shard)


def make_pod(root: Path, gpus: int, lines: int) -> Path:
    from launcher.cli import main as cli_main
    pod = root / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--no-data"]) == 0
    t0 = time.time() - lines * 2.0
    events = [{"ts": t0 - 5, "event": "launch", "stage": 3, "gpus": list(range(gpus))}]
    for gpu in range(gpus):
        with open(pod / "logs" / f"metrics_gpu{gpu}.jsonl", "w") as f:
            for i in range(lines):
                if i == lines // 2:        # a restart halfway
                    f.write(json.dumps({"type": "event", "event": "start", "ts": t0 + 2 * i,
                                        "gpu": gpu, "step": i * 40}) + "\n")
                f.write(json.dumps({
                    "type": "metrics", "ts": t0 + 2.0 * i + gpu * 0.01, "gpu": gpu,
                    "step": 40 * (i + 1), "next_token": 40 * (i + 1) * 1024,
                    "tf": 4.0 + 1 / (1 + i / 1000), "ema_tf": 4.0 + 1 / (1 + i / 1000),
                    "ss": 4.5, "ema_ss": 4.5, "lb": 14.0 + (i % 97) / 1000,
                    "grad_norm": 1.1, "tok_s": 9000.0 + (i * 7919) % 500,
                    "mem_gb": 61.2}) + "\n")
    for k, name in enumerate(("rollback", "stage_change", "sync_pushed", "probe", "canary")):
        events.append({"ts": t0 + lines * (0.3 + 0.1 * k), "event": name, "gpu": 1,
                       "from_stage": 3, "to_stage": 2, "status": "Successful"})
    with open(pod / "logs" / "events.jsonl", "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    return pod


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1100"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def page_ready_ms(driver, url: str) -> float:
    driver.get(url)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready = driver.execute_script("return window.dashboard && window.dashboard.readyMs")
        if ready:
            return float(ready)
        time.sleep(0.05)
    raise RuntimeError("page never ready")


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def measure_dashboard(gpus: int, lines: int, idle_s: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench_dashboard_"))
    try:
        t0 = time.perf_counter()
        pod = make_pod(root, gpus, lines)
        made_s = time.perf_counter() - t0
        size_mb = sum(p.stat().st_size for p in (pod / "logs").glob("*.jsonl")) / 1e6
        t0 = time.perf_counter()
        dash = DashboardProcess(pod, timeout=600)      # returns once it serves: files read
        startup_s = time.perf_counter() - t0
        driver = browser()
        try:
            server = psutil.Process(dash.proc.pid)
            cold = page_ready_ms(driver, dash.url)
            warm = [page_ready_ms(driver, dash.url) for _ in range(5)]
            time.sleep(3)
            before, t = cpu_seconds(server), time.monotonic()
            time.sleep(idle_s)                          # the page polls every 2 s
            open_pct = 100 * (cpu_seconds(server) - before) / (time.monotonic() - t)
            driver.get("about:blank")
            time.sleep(3)
            before, t = cpu_seconds(server), time.monotonic()
            time.sleep(idle_s)
            closed_pct = 100 * (cpu_seconds(server) - before) / (time.monotonic() - t)
            t1 = time.perf_counter()
            status, body = dash.get("/api/data?points=1400")
            full_answer_s = time.perf_counter() - t1
        finally:
            driver.quit()
            dash.stop()
        return {"gpus": gpus, "lines_per_gpu": lines, "metrics_mb": round(size_mb, 1),
                "pod_written_s": round(made_s, 1), "server_startup_s": round(startup_s, 1),
                "page_ready_cold_ms": round(cold),
                "page_ready_warm_ms": [round(w) for w in warm],
                "answer_kb": round(len(body) / 1e3), "full_answer_warm_s": round(full_answer_s, 3),
                "idle_page_open_pct_core": round(open_pct, 3),
                "idle_no_page_pct_core": round(closed_pct, 3)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure_line_cost(n: int = 2000) -> dict:
    from fractus.train.metrics import MetricsWriter
    from fractus.train.tensorboard import TensorBoardScalars
    root = Path(tempfile.mkdtemp(prefix="bench_tb_"))
    fields = dict(step=0, next_token=0, tf=4.1, ema_tf=4.2, ss=4.5, ema_ss=4.6, lb=14.0,
                  grad_norm=1.2, tok_s=9000.0, mem_gb=61.0)
    try:
        plain = MetricsWriter(root / "plain.jsonl", 0)
        mirrored = MetricsWriter(root / "tb.jsonl", 0, TensorBoardScalars(str(root / "tb"), 3))
        times = {"plain": [], "tensorboard": []}
        for i in range(n):                              # interleaved: same machine state
            for name, writer in (("plain", plain), ("tensorboard", mirrored)):
                t = time.perf_counter()
                writer.metrics(**{**fields, "step": i})
                times[name].append(time.perf_counter() - t)
        t = time.perf_counter()
        mirrored.close()
        close_s = time.perf_counter() - t
        plain.close()
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        return {"line_us_plain": round(med["plain"], 1),
                "line_us_tensorboard": round(med["tensorboard"], 1),
                "tb_cost_us_per_line": round(med["tensorboard"] - med["plain"], 1),
                "close_flush_s": round(close_s, 3)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure_worker(steps: int, rounds: int) -> dict:
    """Tiny CPU workers, a metrics line every step, with and without TB_DIR, run in pairs
    side by side; median interval between consecutive lines (= one step)."""
    root = Path(tempfile.mkdtemp(prefix="bench_tbworker_"))
    try:
        write_synth_shard(root / "shard.npy", tokens=400_000)
        intervals = {"plain": [], "tensorboard": []}
        for r in range(rounds):
            procs = {}
            for name in ("plain", "tensorboard"):
                d = root / f"{name}{r}"
                env = worker_env(d, SHARD=root / "shard.npy", MAX_STEPS=steps, LOG_EVERY=1,
                                 TB_DIR=(d / "tb") if name == "tensorboard" else None)
                procs[name] = (start_worker(env), env["METRICS"])
            for name, (proc, metrics) in procs.items():
                proc.communicate(timeout=900)
                ts = [x["ts"] for x in read_jsonl(metrics) if x["type"] == "metrics"]
                intervals[name] += [b - a for a, b in zip(ts[5:], ts[6:])]   # after warm-up
        med = {k: statistics.median(v) * 1e3 for k, v in intervals.items()}
        return {"steps_per_run": steps, "runs_each": rounds,
                "step_ms_plain": round(med["plain"], 2),
                "step_ms_tensorboard": round(med["tensorboard"], 2),
                "ratio": round(med["tensorboard"] / med["plain"], 4)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--worker-steps", type=int, default=300)
    parser.add_argument("--worker-rounds", type=int, default=2)
    parser.add_argument("--skip", default="", help="comma list of: dashboard,line,worker")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    results = {"load_avg_start": os.getloadavg()[0]}
    if "dashboard" not in skip:
        results["dashboard"] = measure_dashboard(args.gpus, args.lines, args.idle_seconds)
        print(json.dumps(results["dashboard"]), flush=True)
    if "line" not in skip:
        results["tensorboard_line"] = measure_line_cost()
        print(json.dumps(results["tensorboard_line"]), flush=True)
    if "worker" not in skip:
        results["tensorboard_worker"] = measure_worker(args.worker_steps, args.worker_rounds)
        print(json.dumps(results["tensorboard_worker"]), flush=True)
    results["load_avg_end"] = os.getloadavg()[0]
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
