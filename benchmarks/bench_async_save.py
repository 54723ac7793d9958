"""Training stall per checkpoint: synchronous save vs asynchronous save, side by side in one run.

One process builds the preset's model and SGD momentum (the state a worker checkpoints,
without gradients), then, on the same state and the same disk:

1. sync: `save_checkpoint(training_payload(...))` on the training thread. Stall = the save.
2. async, twice: `AsyncCheckpointer.submit` (the first allocates the host buffers, the
   second reuses them), then the background write until the file is durable. Stall = what
   `submit` took on the training thread (the snapshot). Then, as the worker does it, fresh
   buffers reserved by `prepare` in the background and a first save into them.
3. memory: resident set size sampled every 20 ms; the peak above the state's own during
   each phase (async: at most one snapshot).

`--stagger K` instead measures K processes writing checkpoints of `--stagger-mb` MB to the
same disk all at once vs one after another (should a pod's workers stagger their saves?).

    python benchmarks/bench_async_save.py --preset tiny
    python benchmarks/bench_async_save.py --preset 1b      # ~18 GB of RAM, ~20 GB of disk
    python benchmarks/bench_async_save.py --preset 1b --n-layers 4   # its shape, 1/4 of the blocks
    python benchmarks/bench_async_save.py --preset 1b --device cuda  # from the GPU, pinned host buffers
    python benchmarks/bench_async_save.py --stagger 4 --stagger-mb 1024
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402


class RssSampler:
    """Peak resident set size between start() and stop(), sampled in a thread."""

    def __init__(self, interval_s: float = 0.02):
        import psutil
        self._process, self._interval = psutil.Process(), interval_s
        self.peak, self._running = 0, False

    def rss(self) -> int:
        return self._process.memory_info().rss

    def start(self) -> "RssSampler":
        self.peak, self._running = self.rss(), True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while self._running:
            self.peak = max(self.peak, self.rss())
            time.sleep(self._interval)

    def stop(self) -> int:
        self._running = False
        self._thread.join()
        return max(self.peak, self.rss())


def build_state(preset: str, batch: int, n_layers: int | None = None, device: str = "cpu"):
    import dataclasses

    import torch
    from fractus.config import load_model_config
    from fractus.continuous_engine import ContinuousThoughtEngine
    torch.manual_seed(0)
    config = load_model_config(preset)
    if n_layers:   # the preset's shape with fewer blocks: its scale where memory is short
        config = dataclasses.replace(config, n_layers=n_layers)
    model = ContinuousThoughtEngine.from_config(config)
    model.reset_thought(batch)
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=7e-4, momentum=0.9)
    for p in model.parameters():   # momentum as after a first step, without holding gradients
        optimizer.state[p]["momentum_buffer"] = torch.full_like(p, 1e-3)
    return model, optimizer


def side_by_side(preset: str, batch: int, threads: int, n_layers: int | None = None,
                 device: str = "cpu") -> dict:
    import torch
    from fractus.train.async_save import AsyncCheckpointer, HostSnapshot
    from fractus.train.checkpoint import save_checkpoint, training_payload
    from fractus.train.env import WorkerSettings
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model, optimizer = build_state(preset, batch, n_layers, device)
    build_s = time.perf_counter() - t0
    # On CUDA the snapshot goes to pinned host buffers, queued on the training stream.
    device, settings = torch.device(device), WorkerSettings.from_env({})
    sampler = RssSampler()

    def payload(step: int) -> dict:
        return training_payload(model, optimizer, settings, next_token=step * 512, step=step,
                                ema_tf=1.0, ema_ss=None, device=device, shard="bench")

    out = {"preset": preset, "n_layers": n_layers, "device": str(device),
           "params": sum(p.numel() for p in model.parameters()),
           "build_s": build_s, "threads": threads}
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        path = Path(tmp) / "fractus_1b_gpu0.pt"
        base = sampler.rss()
        out["state_rss_gb"] = base / 1e9
        sampler.start()
        t = time.perf_counter()
        saved = save_checkpoint(payload(1), path, keep=1)
        out["sync_stall_s"] = time.perf_counter() - t
        out["sync_extra_rss_gb"] = (sampler.stop() - base) / 1e9
        out["bytes"] = saved.bytes

        durable: list[tuple[float, str]] = []
        saver = AsyncCheckpointer(path, 1, device,
                                  on_durable=lambda s, tag, timing: durable.append(
                                      (timing.seconds, s.sha256)))
        base = sampler.rss()
        sampler.start()
        stalls = []
        for step in (2, 3):
            stalls.append(saver.submit(payload(step), step))
            saver.wait()
        out["snapshot_gb"] = saver.snapshot.nbytes / 1e9
        out["async_extra_rss_gb"] = (sampler.stop() - base) / 1e9
        # As the worker runs: buffers reserved in the background after the first step, so
        # the first save finds them (the old ones are dropped first: one snapshot at a time).
        saver.snapshot = HostSnapshot(device)
        t = time.perf_counter()
        saver.prepare(payload(4))
        saver.wait()
        out["prepare_s"] = time.perf_counter() - t
        stalls.append(saver.submit(payload(4), 4))
        saver.wait()
        out["async_stall_first_s"], out["async_stall_s"], out["async_stall_prepared_s"] = stalls
        out["async_durable_s"] = [seconds for seconds, _ in durable]
        from launcher.files import sha256_file
        out["async_file_sha_matches_event"] = sha256_file(path) == durable[-1][1]
    out["stall_ratio"] = out["async_stall_s"] / out["sync_stall_s"]
    out["stall_ratio_first"] = out["async_stall_first_s"] / out["sync_stall_s"]
    out["stall_ratio_prepared"] = out["async_stall_prepared_s"] / out["sync_stall_s"]
    return out


def _stagger_writer(path: str, mb: int, start_at: float) -> float:
    """One worker's save of `mb` MB (run in its own process); returns when it was durable."""
    import torch
    from fractus.train.checkpoint import save_checkpoint
    state = {"model_state": {"w": torch.full((mb * 2**20 // 4,), 1.0)}, "config": {}}
    time.sleep(max(0.0, start_at - time.time()))
    save_checkpoint(state, path, keep=1)
    return time.time()


def stagger(writers: int, mb: int) -> dict:
    """K saves at once vs one after another, each in its own process, same disk."""
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")
    out = {"writers": writers, "mb": mb}
    with tempfile.TemporaryDirectory(dir=REPO) as tmp, ctx.Pool(writers) as pool:
        paths = [str(Path(tmp) / f"fractus_1b_gpu{i}.pt") for i in range(writers)]
        pool.starmap(_stagger_writer, [(p, 1, 0.0) for p in paths])   # warm the processes
        for mode in ("together", "staggered", "together"):
            if mode == "together":
                start = time.time() + 1.0
                ends = pool.starmap(_stagger_writer, [(p, mb, start) for p in paths])
                latencies = [e - start for e in ends]
            else:
                latencies, start = [], time.time()
                for p in paths:
                    latencies.append(pool.apply(_stagger_writer, (p, mb, 0.0)) - start)
            out.setdefault(mode, []).append({"makespan_s": max(latencies),
                                             "mean_latency_s": sum(latencies) / writers})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-layers", type=int, help="the preset with this many blocks")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: state on the GPU, "
                    "snapshot into pinned host memory")
    ap.add_argument("--stagger", type=int, default=0, help="K writer processes (instead)")
    ap.add_argument("--stagger-mb", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=7200, help="seconds for the measurement")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.stagger:
        result = common.run_cell("benchmarks.bench_async_save", "stagger",
                                 {"writers": args.stagger, "mb": args.stagger_mb}, 3600)
        print(json.dumps(result, indent=1))
        if "error" not in result:
            print(f"\n{args.stagger} writers x {args.stagger_mb} MB, same disk:")
            for mode in ("together", "staggered"):
                rows = result[mode]
                print(f"  {mode:9}: makespan " + ", ".join(f"{r['makespan_s']:.2f}" for r in rows)
                      + " s; mean time to durable "
                      + ", ".join(f"{r['mean_latency_s']:.2f}" for r in rows) + " s")
    else:
        result = common.run_cell("benchmarks.bench_async_save", "side_by_side",
                                 {"preset": args.preset, "batch": args.batch,
                                  "threads": args.threads, "n_layers": args.n_layers,
                                  "device": args.device}, args.timeout)
        print(json.dumps(result, indent=1))
        if "error" not in result:
            blocks = f", {args.n_layers} blocks" if args.n_layers else ""
            print(f"\n## checkpoint stall, {args.preset}{blocks} ({result['params']:,} params, "
                  f"{result['bytes'] / 1e9:.2f} GB file), {args.threads} threads\n")
            rows = [["synchronous", common.fmt(result["sync_stall_s"], ".3f"), "-",
                     common.fmt(result["sync_extra_rss_gb"], ".2f")],
                    ["async (first: buffers allocated)",
                     common.fmt(result["async_stall_first_s"], ".3f"),
                     common.fmt(result["async_durable_s"][0], ".2f"), ""],
                    ["async (buffers reused)", common.fmt(result["async_stall_s"], ".3f"),
                     common.fmt(result["async_durable_s"][1], ".2f"),
                     common.fmt(result["async_extra_rss_gb"], ".2f")],
                    ["async (first, buffers prepared in the background: the worker)",
                     common.fmt(result["async_stall_prepared_s"], ".3f"),
                     common.fmt(result["async_durable_s"][2], ".2f"), ""]]
            print(common.markdown_table(["save", "training stall s", "durable after s",
                                         "extra RSS GB"], rows))
            print(f"\nstall async/sync: {result['stall_ratio']:.3f} (first save "
                  f"{result['stall_ratio_first']:.3f}, or {result['stall_ratio_prepared']:.3f} "
                  f"after a background prepare of {result['prepare_s']:.2f} s); "
                  f"goal <= 0.1. Snapshot "
                  f"{result['snapshot_gb']:.2f} GB; load average {result['load_avg']}.")
    if args.json:
        common.write_json_atomic(args.json, result)


if __name__ == "__main__":
    main()
