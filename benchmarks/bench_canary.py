"""Canary overhead per stage switch (issue 6 goal), and the per-step agreement it measures.

Builds a throw-away pod (tiny preset by default: synthetic shard, a checkpoint trained a
few steps at stage 1 by the real worker), then times `run_canary` for each switch:
K steps x 2 real worker processes, sequential (the default) and, with --parallel, at once.
Each row splits the time into the two workers' training loops (the worker's `start` to
`done` events: steps plus the final scratch checkpoint) and the rest (process start,
python + torch import, model and checkpoint load).

`--band` measures the agreement instead of judging it (tolerance set to infinity): the max
relative per-step difference of tf, lb and grad_norm for each exact switch, plus a noise-floor row
(stage M against itself; on CUDA not bitwise deterministic). Run it on a GPU to choose
`canary.exact.cuda` (docs/CANARY.md).

    python benchmarks/bench_canary.py [--steps 5] [--switches 1-2,2-3] [--parallel]
        [--device cpu|cuda] [--model tiny] [--seq 32] [--band] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402
from launcher.checks.canary import run_canary  # noqa: E402
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest  # noqa: E402
from launcher.config.devices import Slot  # noqa: E402
from launcher.config.podconfig import load_pod_config  # noqa: E402
from launcher.pod.setup_init import init_pod, write_config
from launcher.config.stages import load_stages  # noqa: E402
from launcher.paths import metrics_path  # noqa: E402
from launcher.supervise.plan import load_plan  # noqa: E402
from launcher.worker.process import (WorkerSpec, build_env, read_records,  # noqa: E402
                                     worker_command)


def make_pod(root: Path, model: str, seq: int, device: str, train_steps: int) -> Path:
    """A pod with one GPU slot and a full checkpoint trained `train_steps` at stage 1."""
    from fractus.config import load_model_config
    from fractus.data import synth
    pod = root / "pod"
    init_pod(pod, "tiny-cpu")
    config = load_pod_config(pod)
    config.model, config.env = model, {**config.env, "SEQ": str(seq)}   # the preset's fresh start kept
    config.devices = "cpu:1" if device == "cpu" else "cuda:0"
    write_config(pod, config, "bench")
    vocab = load_model_config(model).vocab_size
    synth(pod / "data", shards=1, tokens=200_000, vocab=vocab, seed=0)
    stages = load_stages(pod / config.stages)
    env = build_env(config, WorkerSpec(Slot(0, device), stages[1].settings,
                                       max_steps=train_steps))
    subprocess.run(worker_command(config), cwd=pod, env=env, check=True, capture_output=True)
    event = [r for r in read_records(pod / metrics_path(0)) if r.get("event") == "checkpoint"][-1]
    manifest = read_manifest(pod / config.manifest)
    apply_checkpoint(manifest, 0, event, 1, pod, config.shard_path(0))
    write_manifest(manifest)
    return pod


def loop_seconds(pod: Path, result, stage: int) -> float | None:
    records = read_records(pod / result.scratch / f"stage{stage}" / "metrics.jsonl")
    start = next((r["ts"] for r in records if r.get("event") == "start"), None)
    done = next((r["ts"] for r in records if r.get("event") == "done"), None)
    return None if start is None or done is None else done - start


def max_rel(result, key: str) -> float | None:
    diffs = [abs(getattr(r, f"{key}_to") - getattr(r, f"{key}_from"))
             / max(abs(getattr(r, f"{key}_from")), 1e-30)
             for r in result.per_step
             if getattr(r, f"{key}_to") is not None and getattr(r, f"{key}_from") is not None]
    return max(diffs) if diffs else None


def band_setup(pod: Path, noise_stage: int) -> Path:
    """Infinite exact tolerance (measure, don't judge); returns a two-stage table whose
    stages both hold `noise_stage`'s settings (the noise-floor switch 1->2)."""
    criteria = pod / "manifests" / "trusted_loss.yaml"
    data = yaml.safe_load(criteria.read_text())
    data["canary"] = {"exact": {d: {"rtol": 1e30} for d in ("cpu", "cuda")}}
    criteria.write_text(yaml.safe_dump(data))
    table = yaml.safe_load((pod / "manifests" / "stages.yaml").read_text())
    same = dict(table["stages"][noise_stage], exact=True)
    path = pod / "manifests" / "stages_noise.yaml"
    path.write_text(yaml.safe_dump({"stages": {1: same, 2: dict(same, name="noise floor")}}))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--switches", default="1-2,2-3", help="e.g. 1-2,2-3,3-4 (3-4 compiles)")
    ap.add_argument("--parallel", action="store_true", help="also time the parallel mode")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--band", action="store_true", help="measure per-step agreement")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    switches = [(int(a), int(b), None, f"{a}->{b}")
                for a, b in (s.split("-") for s in args.switches.split(","))]

    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        pod = make_pod(Path(tmp), args.model, args.seq, args.device, args.train_steps)
        setup_s = time.monotonic() - t0
        if args.band:
            first = switches[0][0]
            switches.append((1, 2, band_setup(pod, first), f"{first}->{first} (noise)"))
        modes = [False, True] if args.parallel else [False]
        for a, b, stages_path, label in switches:
            for parallel in modes:
                plan, manifest = load_plan(pod, None, None, None)
                if stages_path is not None:
                    plan = dataclasses.replace(plan, stages=load_stages(stages_path))
                r = run_canary(plan, manifest, 0, a, b, steps=args.steps, device=args.device,
                               parallel=parallel)
                loops = [loop_seconds(pod, r, a), loop_seconds(pod, r, b)]
                entry = {"switch": label, "mode": "parallel" if parallel else "sequential",
                         "passed": r.passed, "exact": r.exact, "seconds": r.seconds,
                         "loop_s": loops, "max_rel_tf": max_rel(r, "tf"),
                         "max_rel_lb": max_rel(r, "lb"),
                         "max_rel_grad_norm": max_rel(r, "grad_norm"), "reason": r.reason}
                results.append(entry)
                rows.append([entry["switch"], entry["mode"], r.status, common.fmt(r.seconds),
                             " / ".join(common.fmt(x, ".2f") for x in loops),
                             common.fmt(entry["max_rel_tf"], ".2e"),
                             common.fmt(entry["max_rel_lb"], ".2e"),
                             common.fmt(entry["max_rel_grad_norm"], ".2e")])
    print(f"device {args.device}, model {args.model}, SEQ {args.seq}, K={args.steps} steps, "
          f"pod setup {setup_s:.1f} s, load avg {os.getloadavg()[0]:.2f}, "
          f"{os.cpu_count()} cores\n")
    print(common.markdown_table(
        ["switch", "mode", "status", "seconds", "training loops M / N (s)", "max rel tf",
         "max rel lb", "max rel grad_norm"], rows))
    if args.json:
        common.write_json_atomic(args.json, {"args": {k: str(v) for k, v in vars(args).items()},
                                             "setup_s": setup_s, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
