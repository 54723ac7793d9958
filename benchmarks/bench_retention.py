"""Hub storage under `retention:` after many pushes of a 4-GPU tiny pod, and what retention costs.

    python benchmarks/bench_retention.py [--pushes 100 --keep 3 --gpus 4 --hub file|hf|both]

Each push is the real `fractus-pod sync push` path (launcher.hub.sync_push.push_now: snapshot,
budget check, one commit, then the retention step) of 4 new passed checkpoints of the tiny
preset's checkpoint size (weights + SGD momentum + buffers, float32; random bytes, so no
layer can deduplicate them). Side by side: the same pushes with no `retention:` (every push
kept). Reported: checkpoint bytes the hub holds after the last push, in units of one push
(goal: <= keep + milestones; no stage changes here, so milestones = 0), and the retention
step's time as a share of the push's own time (goal: < 5 %), median over the pushes.
`--hub hf` runs the test hub (tests/support/hub_server.py) in its own process and talks to it
through the real HfApi (permanently_delete_lfs_files; list_repo_commits and list_lfs_files
only where the retention ledger does not know the push's parent: the first push here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
# bench_hub sets the client's environment for the test hub (plain LFS, its token) on import.
from benchmarks.bench_hub import _start_hub as start_hub  # noqa: E402


def tiny_checkpoint_bytes() -> int:
    """Weights + SGD momentum + buffers of the tiny preset, float32."""
    import dataclasses
    from fractus.config import PRESETS
    from fractus.continuous_engine import ContinuousThoughtEngine
    model = ContinuousThoughtEngine(**dataclasses.asdict(PRESETS["tiny"]))
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() for b in model.buffers())
    return 4 * (2 * params + buffers)


def run(hub_url: str, work: Path, pushes: int, keep: int | None, gpus: int,
        size: int) -> dict:
    import yaml
    from launcher.cli import main as cli_main
    from launcher.hub import open_store
    from launcher.hub.retention_ledger import CHECKPOINT_SUFFIXES
    from launcher.hub.sync_push import push_now
    from launcher.config.podconfig import load_pod_config
    from launcher.pod.events import read_events
    from tests.support.passed_checkpoints import new_checkpoints

    pod = work / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config.update(hub=hub_url, devices=f"cpu:{gpus}",
                  retention=None if keep is None else {"keep": keep})
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    push_s = []
    for n in range(pushes):
        new_checkpoints(pod, 1000 * (n + 1), size, range(gpus))
        started = time.perf_counter()
        push_now(pod, load_pod_config(pod), f"bench push {n}")
        push_s.append(time.perf_counter() - started)
    steps = [e for e in read_events(pod) if e.get("event") == "hub_retention"]
    retention_s = [e["retention_seconds"] for e in steps]
    store = open_store(hub_url, pod)
    head = store.head()
    one_push = sum(e.size for p, e in store.files(head).items()
                   if p.endswith(CHECKPOINT_SUFFIXES))
    stored = store.stored_objects()
    checkpoints = {e.sha256 for h in store.history() for p, e in store.files(h.revision).items()
                   if p.endswith(CHECKPOINT_SUFFIXES)}
    checkpoint_bytes = sum(size for sha, size in stored.items() if sha in checkpoints)
    # Share of the push's own time (push minus the retention step inside it).
    shares = [r / (p - r) for p, r in zip(push_s, retention_s)] if retention_s else []
    return {"pushes": pushes, "keep": keep, "one_push_bytes": one_push,
            "stored_bytes": sum(stored.values()), "checkpoint_bytes": checkpoint_bytes,
            "stored_in_pushes": round(checkpoint_bytes / one_push, 3),
            "push_median_s": round(statistics.median(push_s), 4),
            "retention_median_s": round(statistics.median(retention_s), 4) if retention_s
            else None,
            "retention_share_median": round(statistics.median(shares), 4) if shares else None,
            "retention_share_max": round(max(shares), 4) if shares else None,
            # Steps that read the hub (listings) rather than deciding from the ledger alone.
            "steps_listed": sum(1 for e in steps if e.get("listed", True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=100)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--hub", choices=("file", "hf", "both"), default="both")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    size = tiny_checkpoint_bytes()
    print(f"tiny checkpoint: {size} bytes; {args.gpus} GPUs; {args.pushes} pushes")
    results = []
    backends = ("file", "hf") if args.hub == "both" else (args.hub,)
    for backend in backends:
        for keep in (args.keep, None):
            with tempfile.TemporaryDirectory(prefix="bench_retention_") as tmp:
                work = Path(tmp)
                proc = None
                if backend == "hf":
                    proc, endpoint = start_hub(work)
                    os.environ["HF_ENDPOINT"] = endpoint
                    url = f"hf://bench/retention-{keep}"
                else:
                    url = f"file://{work / 'store'}"
                try:
                    row = {"hub": backend, **run(url, work, args.pushes, keep, args.gpus, size)}
                finally:
                    if proc is not None:
                        proc.terminate()
                        proc.wait(10)
            results.append(row)
            print(json.dumps(row), flush=True)
    print("\n| hub | keep | stored after N pushes (in pushes) | push median | retention "
          "median | retention / push (median, max) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        share = (f"{100 * r['retention_share_median']:.1f} %, "
                 f"{100 * r['retention_share_max']:.1f} %"
                 if r["retention_share_median"] is not None else "-")
        print(f"| {r['hub']} | {r['keep'] or 'all'} | {r['checkpoint_bytes']:,} B "
              f"({r['stored_in_pushes']}) | {r['push_median_s'] * 1000:.1f} ms | "
              f"{(r['retention_median_s'] or 0) * 1000:.1f} ms | {share} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
