"""`fractus-pod adopt` on a synthetic 8-GPU run directory, against `sha256sum` of the same files.

    python benchmarks/bench_adopt.py [--gpus 8 --size-mb 1024 --rounds 3 --dir /tmp/x]

Builds a reference-trainer run directory: --gpus v1-format checkpoints
`checkpoints/fractus_1b_gpu{i}.pt` of --size-mb each (`{"model_state", "config"}` with the
1B config's keys), small `.pt` shards `data/shard_gpu{i}.pt`, and the tracker's manifest.
Then, in interleaved rounds after one untimed warm-up of each (so both read the same warm
page cache): `fractus-pod adopt` as a user runs it (a fresh `python -m launcher.cli`
process: interpreter and torch import included; each round starts from an unadopted
directory), and `sha256sum` of the same files (checkpoints and shards), one process per
file, all started at once. The goal (issue 9): adopt at most 1.2x the parallel sha256sum.
The directory is deleted at the end.
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

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MB = 1 << 20


def build_run(run: Path, gpus: int, size_mb: int) -> list[Path]:
    import torch
    from fractus.config import PRESETS
    target = {k: v for k, v in PRESETS["1b"].to_dict().items() if k != "vocab_size"}
    (run / "checkpoints").mkdir(parents=True)
    (run / "data").mkdir()
    files = []
    for gpu in range(gpus):
        generator = torch.Generator().manual_seed(gpu)
        weights = torch.rand(size_mb * MB // 4, generator=generator)
        path = run / f"checkpoints/fractus_1b_gpu{gpu}.pt"
        torch.save({"model_state": {"observe.weight": weights},
                    "config": {**target, "gpu": gpu, "tokens_processed": 4096}}, path)
        del weights
        shard = run / f"data/shard_gpu{gpu}.pt"
        torch.save(torch.arange(1 << 20, dtype=torch.int64) % 50257, shard)
        files += [path, shard]
    (run / "checkpoints/RESUME_MANIFEST_8GPU.json").write_text(json.dumps(
        {f"gpu_{gpu}": {"start_token": 4096} for gpu in range(gpus)}))
    return files


def unadopt(run: Path) -> None:
    for rel in ("fractus-pod.yaml", "manifests", "checkpoints/adopted", "logs"):
        path = run / rel
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def time_adopt(run: Path, gpus: int) -> float:
    unadopt(run)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-P", "-m", "launcher.cli", "--pod-dir", str(run),
                           "adopt", "--devices", f"cuda:0-{gpus - 1}"],
                          env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"adopt failed: {done.stderr.strip()}")
    return elapsed


def time_sha256sum(files: list[Path]) -> float:
    start = time.perf_counter()
    procs = [subprocess.Popen(["sha256sum", str(f)], stdout=subprocess.DEVNULL) for f in files]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("sha256sum failed")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to build the run (default: a temp dir)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_adopt_"))
    run = base / "run"
    try:
        t0 = time.perf_counter()
        files = build_run(run, args.gpus, args.size_mb)
        total_gb = sum(f.stat().st_size for f in files) / 2**30
        print(f"built {len(files)} files, {total_gb:.2f} GiB, in {time.perf_counter() - t0:.0f} s")
        time_sha256sum(files)          # warm-up: the same page cache for both
        time_adopt(run, args.gpus)
        adopt_s, sums_s = [], []
        for _ in range(args.rounds):
            sums_s.append(time_sha256sum(files))
            adopt_s.append(time_adopt(run, args.gpus))
        a, s = statistics.median(adopt_s), statistics.median(sums_s)
        print(f"| method | rounds (s) | median (s) | GiB/s |")
        print(f"|---|---|---|---|")
        print(f"| `sha256sum`, one process per file, in parallel | "
              f"{', '.join(f'{x:.2f}' for x in sums_s)} | {s:.2f} | {total_gb / s:.2f} |")
        print(f"| `fractus-pod adopt` (new process) | "
              f"{', '.join(f'{x:.2f}' for x in adopt_s)} | {a:.2f} | {total_gb / a:.2f} |")
        print(f"| **ratio adopt / sha256sum** | | **{a / s:.2f}x** | |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
