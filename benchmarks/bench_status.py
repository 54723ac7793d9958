"""`fractus-pod status` while a pod trains: the wall time of the real command (a new Python
process each time, as a person runs it; and its CPU time, which a machine's load does not
stretch), with the pod idle and while the real launcher
supervises tiny CPU workers training on every core of the machine. Goal: under 0.5 s while
training (status reads files: no torch import, docs/LAUNCHER.md).

Also measured: whether the command imported torch (it must not), and `status --json`.

    python benchmarks/bench_status.py [--repeats 7] [--gpus 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.e2e import make_pod, worker_records  # noqa: E402

# Runs the CLI's main() and reports on stderr whether torch was imported.
PROBE = ("import sys\nfrom launcher.cli.main import main\n"
         "code = main(sys.argv[1:])\n"
         "print('TORCH', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)\n")


def time_status(pod: Path, repeats: int, *extra: str) -> dict:
    walls, cpus, torch_seen = [], [], False
    for _ in range(repeats):
        t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-c", PROBE, "--pod-dir", str(pod), "status",
                               *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
        walls.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        assert done.returncode == 0, done.stderr
        torch_seen |= "TORCH True" in done.stderr
    return {"median_s": round(statistics.median(walls), 3), "max_s": round(max(walls), 3),
            "cpu_s": round(statistics.median(cpus), 3), "torch_imported": torch_seen}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--gpus", type=int, default=2, help="tiny CPU workers training")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pod = make_pod(Path(tmp))
        results = {"idle": time_status(pod, args.repeats),
                   "idle_json": time_status(pod, args.repeats, "--json")}
        gpus = ",".join(str(g) for g in range(args.gpus))
        log = open(Path(tmp) / "launcher.out", "w")
        launcher = subprocess.Popen(
            [sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), "launch",
             "--stage", "1", "--gpus", gpus, "--devices", f"cpu:{args.gpus}"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while not all(worker_records(pod, g, "checkpoint") for g in range(args.gpus)):
                assert time.monotonic() < deadline and launcher.poll() is None, "no training"
                time.sleep(0.5)
            results["training"] = time_status(pod, args.repeats)
            results["training_json"] = time_status(pod, args.repeats, "--json")
            results["load_avg_1m"] = round(os.getloadavg()[0], 2)
        finally:
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(300)
            log.close()
    results.update(cores=os.cpu_count(), workers=args.gpus)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
