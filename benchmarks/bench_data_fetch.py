"""Fetching a pod's shards from a dataset repo on the test hub, next to the plain client.

    python benchmarks/bench_data_fetch.py [--shards 8 --size-mb 1024 --rounds 3]

N shards of --size-mb random bytes are pushed once (`fractus-pod data push`'s code) to a
dataset repo on the test hub (tests/support/hub_server.py, its own process on 127.0.0.1,
the real huggingface_hub client). Then, in interleaved rounds, each into an empty directory:

- fetch: `launcher.hub.fetch.ensure_shards` (the launch's path: index read, each shard
  streamed into its .partial file and hashed as it arrives, fsync, rename);
- plain client: `hf_hub_download` of each shard at the same revision, then `sha256sum` of
  all of them (the same bytes downloaded, then hashed: what a person does by hand).

Goal (issue 18): fetch at most 1.3x the plain client's time. Prints one table (median of the
rounds, every round's seconds) and the ratio.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_hub import BENCH_TOKEN, _random_file, _start_hub   # sets the client's environment

REPO_ID = "bench/shards"
GOAL = 1.3


def _fetch(source, shards: list[str], dest: Path) -> None:
    from launcher.hub.fetch import ensure_shards
    ensure_shards(shards, source, dest)


def _plain(source, shards: list[str], dest: Path) -> None:
    from huggingface_hub import hf_hub_download
    for rel in shards:
        hf_hub_download(REPO_ID, rel, repo_type="dataset", revision=source.revision,
                        local_dir=dest)
    subprocess.run(["sha256sum", *shards], cwd=dest, check=True, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args()
    from launcher.hub import RetryPolicy
    from launcher.hub.data_source import push_shards
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        hub, url = _start_hub(work)
        try:
            import os
            os.environ["HF_ENDPOINT"] = url
            assert os.environ["HF_TOKEN"] == BENCH_TOKEN
            source_pod = work / "source"
            shards = [f"data/shard_gpu{i}.npy" for i in range(args.shards)]
            (source_pod / "data").mkdir(parents=True)
            for rel in shards:
                _random_file(source_pod / rel, args.size_mb)
            start = time.perf_counter()
            source, _ = push_shards(source_pod, shards, f"hf://datasets/{REPO_ID}",
                                    RetryPolicy())
            print(f"pushed {args.shards} x {args.size_mb} MB in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
            shutil.rmtree(source_pod)          # the hub keeps its own copy: disk for rounds
            times: dict[str, list[float]] = {"fetch": [], "plain": []}
            for _ in range(args.rounds):
                for name, run in (("fetch", _fetch), ("plain", _plain)):
                    dest = work / name
                    start = time.perf_counter()
                    run(source, shards, dest)
                    times[name].append(time.perf_counter() - start)
                    shutil.rmtree(dest)
        finally:
            hub.kill()
            hub.wait()
    total_mb = args.shards * args.size_mb
    print(f"\n{args.shards} shards x {args.size_mb} MB ({total_mb / 1024:.2f} GB), "
          f"{args.rounds} rounds, median:\n")
    print("| | s | MB/s | rounds (s) |\n|---|---|---|---|")
    labels = {"fetch": "**ensure_shards (fetch, hash as it arrives, fsync, rename)**",
              "plain": "hf_hub_download each, then sha256sum"}
    for name, label in labels.items():
        median = statistics.median(times[name])
        print(f"| {label} | {median:.2f} | {total_mb / median:.0f} | "
              f"{' '.join(f'{t:.2f}' for t in times[name])} |")
    ratio = statistics.median(times["fetch"]) / statistics.median(times["plain"])
    print(f"\nfetch / plain client: {ratio:.2f}x (goal: at most {GOAL}x): "
          f"{'met' if ratio <= GOAL else 'NOT met'}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
