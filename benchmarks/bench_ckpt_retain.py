"""The cost of retaining a checkpoint whose event is read late (CheckpointIndex.add).

A node's poll or the head's supervisor that falls behind its worker reads a save's event
after k newer saves: its bytes are then at `name.k`. Before the fix every candidate on the
way down was hashed (k hashes per event, k^2 for a backlog: the poll never caught up and the
launcher killed its worker as hung, CI stop 23); now the size and mtime the worker reported
pick the one candidate. Both ways side by side in one run, on the same files:

  mtime     the event as the worker writes it (bytes, mtime_ns): one hash per event
  no mtime  the event without its mtime (a v1 worker's event, and the old code's cost):
            every candidate down to name.k hashed

    python benchmarks/bench_ckpt_retain.py [--saves 400] [--mb 1.2] [--late 0 50 200 399]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import markdown_table  # noqa: E402
from fractus.train.checkpoint import save_checkpoint  # noqa: E402
from launcher.pod.ckpt_index import CheckpointIndex  # noqa: E402

PATH = "checkpoints/fractus_1b_gpu0.pt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=400)
    parser.add_argument("--mb", type=float, default=1.2, help="checkpoint size in MB")
    parser.add_argument("--late", type=int, nargs="+", default=[0, 50, 200, 399])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pod = Path(tmp) / "pod"
        numel = int(args.mb * 1e6 / 4)
        saved = []
        for n in range(args.saves):      # the worker's real saves: rename, rotate, mtime
            weights = torch.full((numel,), float(n))
            saved.append(save_checkpoint({"model_state": {"w": weights}}, pod / PATH,
                                         keep=args.saves + 1))
        rows = []
        for late in args.late:
            n = args.saves - 1 - late          # its bytes now sit `late` names down
            cells = {}
            for label, with_mtime in (("mtime", True), ("no mtime", False)):
                times = []
                for _ in range(args.repeats):
                    index = CheckpointIndex(Path(tmp) / f"index-{label}-{late}-{len(times)}")
                    index.pod_dir = pod            # the pod's files, a fresh record file
                    event = {"sha256": saved[n].sha256, "next_token": n, "step": n,
                             "bytes": saved[n].bytes}
                    if with_mtime:
                        event["mtime_ns"] = saved[n].mtime_ns
                    start = time.perf_counter()
                    record = index.add(0, event, stage=1, path=PATH)
                    times.append((time.perf_counter() - start) * 1000)
                    assert record["retained"], record
                    (pod / record["retained"]).unlink()
                cells[label] = statistics.median(times)
            rows.append([late, f"{cells['mtime']:.1f}", f"{cells['no mtime']:.1f}",
                         f"{cells['no mtime'] / cells['mtime']:.0f}x"])
        print(f"{args.saves} saves of {saved[0].bytes / 1e6:.2f} MB; median of "
              f"{args.repeats}, ms per event")
        print(markdown_table(["read k saves late", "mtime (now)", "no mtime (before)",
                              "ratio"], rows))


if __name__ == "__main__":
    main()
