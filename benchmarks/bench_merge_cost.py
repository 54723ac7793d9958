"""Merge rounds, cost at the 1B shapes: what one round stalls a GPU, the merge's memory, the
bytes a round pushes; against the goal (a round every hour: at most 2 % of GPU time).

Owner: the merge-rounds work. Invariant: every measured phase runs the project's own code on
state of the preset's real shapes and dtypes (the model built on `meta`, then `to_empty` on
the CPU and filled with finite values: no initialisation to wait for), each in a process of
its own (benchmarks/common.run_cell: its own peak RSS; a kill is an error cell, not a crash),
and every file is deleted at the end. Measured here:

1. save: `save_checkpoint(training_payload(...))` of one GPU's state (weights, SGD momentum,
   carried state at --batch), the worker's durable save (a round waits for the file).
   Then --sources files of {"model_state", "config"} for the merge (a worker's checkpoint
   without its optimizer state: the merge mmaps model_state only, so it reads the same
   bytes; the disk holds half as many).
2. merge: `outer_step` round 1 (`mean`, 2 sources, committed: the outer state exists), then
   round 2 (`nesterov` lr 0.7, momentum 0.9, commit=False as the orchestration runs it) over
   the first n sources for each n of --sources; wall time, CPU time, peak RSS and its
   anonymous part (sampled from /proc/self/status every 50 ms; mmapped file pages count in
   RSS but the kernel can drop them). The files are evicted from the page cache first
   (posix_fadvise DONTNEED on our own files): cold reads.
3. adoption: `read_merged` (sha256, weights-only mmapped load, every check) + `adopt`
   (`copy_` in place) of the round file into a model of the preset's shapes (cold cache).
4. gate: the launcher's gate runs `python -m fractus.eval.merge_gate` per quorum GPU on the
   CPU, one thread: its model built, then two teacher-forced passes (own and merged
   weights) over `window_tokens` (trusted_loss.yaml, 4096) in 4 rows, `seq` 128 a chunk.
   Measured at the preset's widths with 1 and 2 blocks (the model's construction and one
   chunk of the pass, one thread), extrapolated linearly to its blocks; the GPU variant is
   a FLOP estimate (2 x the parameters a token uses, per token and pass; attention and ODE
   terms not counted, as benchmarks/gpu_ladder.py) at --gpu-mfu of --gpu-tflops, plus the
   same model build and file reads. The AR probe (probe: 1) is not counted.
5. bytes pushed: the round file, the outer state, the ledger (a one-round ledger with
   --gpus GPUs, in the shared design's layout; it grows by one record a round).

Projected for a pod (not measured; every assumption is a flag and printed): 8 GPUs saving
at once to one NVMe (--pod-write-gbps; each save also hashes at this CPU's measured sha256
rate), the merge = its CPU time here + its bytes at the pod's disk rates, adoption = sha256
of the round file + a host-to-device copy (--h2d-gbps), the gate as implemented (CPU, one
thread, GPUs in parallel: one GPU's time) or on the GPU.

    python benchmarks/bench_merge_cost.py --json /tmp/merge_cost.json   # 1B: ~55 GB disk, ~20 GB RAM
    python benchmarks/bench_merge_cost.py --smoke      # tiny preset, in one process, seconds

tests/test_bench_merge_cost.py runs --smoke and checks the report's fields.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402

GB = 1e9
ROWS = 4          # fractus.eval.merge_gate's rows per window
MARGIN_BYTES = 8 * 2**30   # disk left free for the other users of the machine


class Peaks:
    """Peak VmRSS and RssAnon (bytes) of this process between start() and stop()."""

    def __init__(self, interval_s: float = 0.05):
        self.interval, self.rss, self.anon, self._on = interval_s, 0, 0, False

    @staticmethod
    def now() -> tuple[int, int]:
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields.get("VmRSS", 0), fields.get("RssAnon", 0)

    def _sample(self) -> None:
        rss, anon = self.now()
        self.rss, self.anon = max(self.rss, rss), max(self.anon, anon)

    def _run(self) -> None:
        while self._on:
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> "Peaks":
        self.rss, self.anon = self.now()
        self._on = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._on = False
        self._thread.join()
        self._sample()


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def evict(paths) -> None:
    """Drop our own files' pages from the page cache (they were fsynced): cold reads."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def engine_config(preset: str, n_layers: int | None = None):
    import dataclasses

    from fractus.config import load_model_config
    cfg = load_model_config(preset)
    return dataclasses.replace(cfg, n_layers=n_layers) if n_layers else cfg


def empty_model(preset: str, batch: int, n_layers: int | None = None, value: float = 0.0):
    """The preset's engine with its carried state for `batch` rows, every floating tensor
    `value`: real shapes, dtypes, names and tied weights, no initialisation."""
    import torch

    from fractus.continuous_engine import ContinuousThoughtEngine
    with torch.device("meta"):
        model = ContinuousThoughtEngine.from_config(engine_config(preset, n_layers))
    model.reset_thought(batch)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.fill_(value)
    return model


def sizes(preset: str, batch: int) -> dict:
    """Bytes of the parameters and of model_state (carried state included), from `meta`."""
    import torch

    from fractus.continuous_engine import ContinuousThoughtEngine
    with torch.device("meta"):
        model = ContinuousThoughtEngine.from_config(engine_config(preset))
        model.reset_thought(batch)
    params = {id(p): p for p in model.parameters()}.values()
    return {"param_bytes": sum(p.numel() * p.element_size() for p in params),
            "state_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
            "n_params": sum(p.numel() for p in params)}


def sha256_rate() -> float:
    """sha256 of 256 MiB in memory, GB/s: the hashing every save and adoption does."""
    import hashlib
    block = os.urandom(256 * 2**20)
    start = time.perf_counter()
    hashlib.sha256(block).hexdigest()
    return len(block) / (time.perf_counter() - start) / GB


def save_and_sources(preset: str, batch: int, folder: str, n_sources: int) -> dict:
    """(1): one GPU's save at the preset's shapes, timed; then the merge's source files."""
    import torch

    from fractus.train.checkpoint import save_checkpoint, training_payload
    from fractus.train.env import WorkerSettings
    folder_path = Path(folder)
    model = empty_model(preset, batch, value=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=7e-4, momentum=0.9)
    for p in model.parameters():       # momentum as after a first step
        optimizer.state[p]["momentum_buffer"] = torch.full_like(p, 1e-3)
    payload = training_payload(model, optimizer, WorkerSettings.from_env({}), next_token=4096,
                               step=8, ema_tf=3.0, ema_ss=None, device=torch.device("cpu"),
                               shard="bench")
    out = {"sha256_gbps": sha256_rate()}
    path = folder_path / "fractus_1b_gpu0.pt"
    with Peaks() as peaks:
        t, c = time.perf_counter(), cpu_s()
        saved = save_checkpoint(payload, path, keep=1)
        out.update(save_s=time.perf_counter() - t, save_cpu_s=cpu_s() - c, save_bytes=saved.bytes)
    out["save_peak_rss_gb"] = peaks.rss / GB
    path.unlink()
    del payload, optimizer
    sources = []
    for i in range(n_sources):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.01 * (i + 1))
        t = time.perf_counter()
        saved = save_checkpoint({"model_state": model.state_dict(), "config": {"gpu": i}},
                                folder_path / f"fractus_1b_gpu{i}.pt", keep=1)
        sources.append({"path": saved.path, "bytes": saved.bytes,
                        "seconds": time.perf_counter() - t})
    out["sources"] = sources
    return out


def merge(pod: str, sources: list, round_n: int, step: str, lr: float, momentum: float,
          commit: bool) -> dict:
    """(2): `outer_step` over `sources`, cold, timed and its memory sampled."""
    from launcher.hub.outer_step import OuterSettings, outer_step
    from launcher.paths import OUTER_STATE_FILE
    outer = Path(pod) / OUTER_STATE_FILE
    reads = list(sources) + ([outer] if outer.exists() else [])
    evict(reads)
    with Peaks() as peaks:
        t, c = time.perf_counter(), cpu_s()
        report = outer_step(pod, round_n, sources, OuterSettings(step, lr, momentum),
                            commit=commit)
        seconds, cpu = time.perf_counter() - t, cpu_s() - c
    return {"n": len(sources), "round": round_n, "step": step, "seconds": seconds, "cpu_s": cpu,
            "file_bytes_read": sum(Path(p).stat().st_size for p in reads),
            "bytes_written": report.bytes_written, "sha256": report.sha256,
            "merged": str(report.merged_path), "outer_state": str(report.outer_state_path),
            "peak_rss_gb": peaks.rss / GB, "peak_anon_gb": peaks.anon / GB}


def adoption(preset: str, batch: int, pod: str, rel: str, sha256: str) -> dict:
    """(3): the worker's read_merged + adopt of the round file, cold."""
    import torch

    from fractus.train.merge_inbox import adopt, parse_inbox, read_merged
    model = empty_model(preset, batch)
    entry = parse_inbox({"round": 2, "path": rel, "sha256": sha256})
    evict([Path(pod) / rel])
    with Peaks() as peaks:
        t, c = time.perf_counter(), cpu_s()
        params = read_merged(entry, Path(pod), model)
        read_s = time.perf_counter() - t
        adopt(model, params)
        seconds = time.perf_counter() - t
        used = cpu_s() - c
    first = next(iter(model.parameters()))
    return {"read_s": read_s, "copy_s": seconds - read_s, "seconds": seconds, "cpu_s": used,
            "bytes": (Path(pod) / rel).stat().st_size, "tensors": len(params),
            "adopted": bool(torch.all(first != 0)), "peak_rss_gb": peaks.rss / GB,
            "peak_anon_gb": peaks.anon / GB}


def gate(preset: str, layers: list, seq: int, window_tokens: int, chunks: int) -> dict:
    """(4): the gate's model construction and one teacher-forced chunk (ROWS x seq tokens),
    one thread, at the preset's widths with each of `layers` blocks."""
    import torch
    import torch.nn.functional as F

    from fractus.continuous_engine import ContinuousThoughtEngine
    torch.set_num_threads(1)
    out = {"threads": 1, "seq": seq, "rows": ROWS, "window_tokens": window_tokens, "by_layers": {}}
    for n_layers in layers:
        cfg = engine_config(preset, n_layers)
        builds = []
        for _ in range(2):      # the first build of a process pays its warm-up
            t = time.perf_counter()
            model = ContinuousThoughtEngine.from_config(cfg)   # as the gate's child builds it
            builds.append(time.perf_counter() - t)
        build_s = min(builds)
        model.eval()
        model.reset_thought(ROWS)
        ids = torch.randint(0, cfg.vocab_size, (ROWS, chunks * seq + 1))
        times = []
        with torch.no_grad():
            for i in range(chunks):
                t = time.perf_counter()
                logits = model.tick_chunk(ids[:, i * seq:(i + 1) * seq])
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                ids[:, i * seq + 1:(i + 1) * seq + 1].reshape(-1)).item()
                times.append(time.perf_counter() - t)
        steady = times[1:] or times      # the first chunk warms up
        out["by_layers"][str(n_layers)] = {"build_s": build_s,
                                           "chunk_s": sum(steady) / len(steady)}
        del model
    return out


def extrapolate(by_layers: dict, n_layers: int, key: str) -> float:
    """Linear in the blocks through the two smallest measured counts."""
    (l1, a), (l2, b) = sorted((int(k), v[key]) for k, v in by_layers.items())[:2]
    per_block = (b - a) / (l2 - l1)
    return a + per_block * (n_layers - l1)


def ledger_bytes(gpus: int) -> int:
    """One round's ledger (the shared design's layout), as JSON, with `gpus` GPUs."""
    record = {"round": 2, "stage": "3", "boundary": 1, "state": "adopted",
              "gpus": {str(g): {"at_token": 100_000_000 + g, "sha256": "0" * 64,
                                "checkpoint": f"checkpoints/fractus_1b_gpu{g}.pt",
                                "tokens": 50_000_000} for g in range(gpus)},
              "left_out": [], "weights": [1.0 / gpus] * gpus,
              "outer": {"step": "nesterov", "lr": 0.7, "momentum": 0.9},
              "merged": "merge/round_00002.pt", "merged_sha256": "0" * 64,
              "gate": {"gpus": {str(g): {"own_tf": 3.0123, "merged_tf": 3.0456, "rise": 0.0333}
                                for g in range(gpus)}, "limit": 0.1, "probe": None},
              "reason": "every GPU's next-window loss within 0.1 (worst +0.0333, GPU 0)",
              "seconds": 123.4}
    ledger = {"format": "fractus-pod-rounds-v1",
              "origins": {"3": {str(g): 0 for g in range(gpus)}}, "rounds": [record]}
    return len(json.dumps(ledger, indent=1).encode())


def project(r: dict, a) -> dict:
    """The stall per GPU per round, here (measured) and on a pod (projected)."""
    save, merge8, adopt_, gate_ = r["save"], r["merge"][-1], r["adoption"], r["gate"]
    p, c = r["sizes"]["param_bytes"], save["save_bytes"]
    hash_s = c / GB / save["sha256_gbps"]
    gate_reads = c + r["pushed"]["round_file"]    # its child loads the checkpoint and the round
    merge_io = merge8["file_bytes_read"] / GB / a.pod_read_gbps \
        + merge8["bytes_written"] / GB / a.pod_write_gbps
    # CPU-bound here (CPU time >= wall): a pod's host is assumed no slower than this one
    pod = {"save": max(hash_s, a.gpus * c / GB / a.pod_write_gbps),
           "merge": max(merge8["seconds"], merge_io),
           "gate": gate_["cpu_s"] + gate_reads / GB / a.pod_read_gbps,
           "adoption": adopt_["bytes"] / GB / save["sha256_gbps"] + p / GB / a.h2d_gbps}
    here = {"save": save["save_s"], "merge": merge8["seconds"],
            "gate": gate_["cpu_s"] + gate_reads / adopt_["bytes"] * adopt_["read_s"],
            "adoption": adopt_["seconds"]}
    out = {"merge_io_pod_s": merge_io}
    for name, parts in (("here", here), ("pod", pod),
                        ("pod_gpu_gate", {**pod, "gate": gate_["build_s"] + gate_["gpu_s"]
                                          + gate_reads / GB / a.pod_read_gbps})):
        total = sum(parts.values())
        out[name] = {**parts, "total": total, "fraction": total / a.round_every_s,
                     "every_h_for_2pct": total / 0.02 / 3600}
    return out


def run(a) -> dict:
    """Every phase in order on one folder; the folder is removed at the end."""
    in_process = a.smoke

    def cell(func: str, timeout: float, **kwargs) -> dict:
        if in_process:
            result = dict(globals()[func](**kwargs))
            result["peak_rss_mb"] = common.peak_rss_mb()
        else:
            result = common.run_cell("benchmarks.bench_merge_cost", func, kwargs, timeout)
        if "error" in result:
            raise SystemExit(f"{func}: {result['error']}")
        return result

    from launcher.paths import OUTER_STATE_PENDING, merged_round_path
    work = Path(tempfile.mkdtemp(prefix="bench_merge_cost_", dir=a.dir))
    pod, folder = work / "pod", work / "checkpoints"
    folder.mkdir()
    r = {"preset": a.preset, "batch": a.batch, "sizes": sizes(a.preset, a.batch),
         "machine": {"cpus": os.cpu_count(), "mem_gb": os.sysconf("SC_PAGE_SIZE")
                     * os.sysconf("SC_PHYS_PAGES") / GB,
                     "disk_free_gb": shutil.disk_usage(work).free / GB,
                     "load_avg": os.getloadavg()[0]},
         "assumptions": {k: getattr(a, k) for k in ("gpus", "pod_write_gbps", "pod_read_gbps",
                                                    "h2d_gbps", "gpu_tflops", "gpu_mfu",
                                                    "round_every_s", "window_tokens")}}
    try:
        s, p = r["sizes"]["state_bytes"], r["sizes"]["param_bytes"]
        free = shutil.disk_usage(work).free - MARGIN_BYTES
        fits = [n for n in a.sources if n * s * 1.01 + 5 * p <= free]
        r["sources_skipped"] = [n for n in a.sources if n not in fits]
        if not fits:
            raise SystemExit(f"not enough disk in {work} for 2 sources of {s / GB:.1f} GB")
        r["save"] = cell("save_and_sources", 3600, preset=a.preset, batch=a.batch,
                         folder=str(folder), n_sources=max(fits))
        paths = [src["path"] for src in r["save"]["sources"]]
        r["round1"] = cell("merge", 3600, pod=str(pod), sources=paths[:2], round_n=1,
                           step="mean", lr=1.0, momentum=0.0, commit=True)
        (pod / merged_round_path(1)).unlink()
        r["merge"] = []
        for n in fits:
            for rel in (merged_round_path(2), OUTER_STATE_PENDING):
                (pod / rel).unlink(missing_ok=True)
            r["merge"].append(cell("merge", 3600, pod=str(pod), sources=paths[:n], round_n=2,
                                   step="nesterov", lr=0.7, momentum=0.9, commit=False))
        for path in paths:            # the adoption needs the room and the memory
            Path(path).unlink()
        last = r["merge"][-1]
        r["adoption"] = cell("adoption", 3600, preset=a.preset, batch=a.batch, pod=str(pod),
                             rel=merged_round_path(2), sha256=last["sha256"])
        g = cell("gate", 3600, preset=a.preset, layers=[1, 2], seq=a.seq,
                 window_tokens=a.window_tokens, chunks=a.gate_chunks)
        n_layers = engine_config(a.preset).n_layers
        chunks = -(-(a.window_tokens // ROWS) // a.seq)     # chunks of one row's window
        g["build_s"] = extrapolate(g["by_layers"], n_layers, "build_s")
        g["chunk_s"] = extrapolate(g["by_layers"], n_layers, "chunk_s")
        g["cpu_s"] = g["build_s"] + 2 * chunks * g["chunk_s"]    # own + merged passes
        from benchmarks.gpu_ladder import flops_per_token
        active = flops_per_token(a.preset)["active_params"]
        g["flops"] = 2 * (2 * active) * ROWS * chunks * a.seq
        g["gpu_s"] = g["flops"] / (a.gpu_tflops * 1e12 * a.gpu_mfu)
        r["gate"] = g
        outer_bytes = Path(last["outer_state"]).stat().st_size
        merged_bytes = Path(last["merged"]).stat().st_size
        r["pushed"] = {"round_file": merged_bytes, "outer_state": outer_bytes,
                       "ledger_one_round": ledger_bytes(a.gpus),
                       "total": merged_bytes + outer_bytes + ledger_bytes(a.gpus)}
        r["stall"] = project(r, a)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return r


def table(r: dict, a) -> str:
    """The report: one row per measurement, then the stall per GPU per round."""
    f, save, g = common.fmt, r["save"], r["gate"]
    rows = [["save of one GPU's checkpoint (weights + momentum + carried)",
             f"{f(save['save_s'], '.1f')} s", f"{f(save['save_bytes'] / GB, '.2f')} GB file, "
             f"peak RSS {f(save['save_peak_rss_gb'], '.1f')} GB", "measured"]]
    rows.append(["round 1 (`mean`, 2 sources, committed: the outer state)",
                 f"{f(r['round1']['seconds'], '.1f')} s",
                 f"peak RSS {f(r['round1']['peak_rss_gb'], '.1f')} GB, anonymous "
                 f"{f(r['round1']['peak_anon_gb'], '.1f')} GB", "measured"])
    for m in r["merge"]:
        rows.append([f"`outer_step` round 2 (`nesterov`), {m['n']} sources",
                     f"{f(m['seconds'], '.1f')} s (CPU {f(m['cpu_s'], '.1f')} s)",
                     f"peak RSS {f(m['peak_rss_gb'], '.1f')} GB, anonymous "
                     f"{f(m['peak_anon_gb'], '.1f')} GB; read {f(m['file_bytes_read'] / GB, '.1f')}"
                     f" GB, wrote {f(m['bytes_written'] / GB, '.1f')} GB", "measured"])
    ad = r["adoption"]
    rows.append(["adoption (`read_merged` + `adopt`)", f"{f(ad['seconds'], '.1f')} s",
                 f"sha256 + load + checks {f(ad['read_s'], '.1f')} s, copy_ "
                 f"{f(ad['copy_s'], '.1f')} s; peak RSS {f(ad['peak_rss_gb'], '.1f')} GB",
                 "measured"])
    by = ", ".join(f"{k} block(s): build {f(v['build_s'], '.2f')} s, chunk {f(v['chunk_s'], '.3f')} s"
                   for k, v in g["by_layers"].items())
    rows.append([f"gate, CPU 1 thread ({g['window_tokens']} tokens x 2 passes)",
                 f"{f(g['cpu_s'], '.0f')} s", f"from {by}; extrapolated: build "
                 f"{f(g['build_s'], '.1f')} s + chunk {f(g['chunk_s'], '.2f')} s", "extrapolated"])
    rows.append(["gate on the GPU (same window, 2 passes)", f"{f(g['gpu_s'], '.3f')} s",
                 f"{f(g['flops'] / 1e12, '.2f')} TFLOP at {a.gpu_mfu:g} of {a.gpu_tflops:g} TFLOP/s",
                 "estimate"])
    pu = r["pushed"]
    rows.append(["bytes pushed per round", f"{f(pu['total'] / GB, '.2f')} GB",
                 f"round file {f(pu['round_file'] / GB, '.2f')} GB + outer state "
                 f"{f(pu['outer_state'] / GB, '.2f')} GB + ledger {pu['ledger_one_round']:,} B a "
                 f"round", "measured"])
    out = [common.markdown_table(["phase", "time", "detail", "how"], rows), ""]
    stall_rows = []
    for name, label in (("here", "this machine (gate: CPU, extrapolated)"),
                        ("pod", "pod, projected (gate on the CPU, as implemented)"),
                        ("pod_gpu_gate", "pod, projected (gate on the GPU)")):
        s = r["stall"][name]
        stall_rows.append([label] + [f(s[k], ".1f") for k in ("save", "merge", "gate", "adoption",
                                                              "total")]
                          + [f"{100 * s['fraction']:.2f} %", f(s["every_h_for_2pct"], ".1f")])
    out.append(common.markdown_table(["stall per GPU per round, s", "save", "merge", "gate",
                                      "adoption", "total", f"of {a.round_every_s:g} s",
                                      "rounds at least every (h) for 2 %"], stall_rows))
    return "\n".join(out)


def machine_line(r: dict) -> str:
    m = r["machine"]
    return (f"{m['cpus']} CPUs, {m['mem_gb']:.0f} GB RAM, {m['disk_free_gb']:.0f} GB disk free; "
            f"load average {m['load_avg']:.1f} at the start; {r['wall_s']:.0f} s in all"
            + (f"; skipped for disk: {r['sources_skipped']}" if r["sources_skipped"] else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--batch", type=int, default=4, help="carried state rows (stage 1-3's BATCH)")
    ap.add_argument("--sources", default="2,4,8", help="merge sizes (checkpoints per round)")
    ap.add_argument("--dir", default=None, help="where the files go (default: the temp dir)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--window-tokens", type=int, default=4096, help="the gate's window")
    ap.add_argument("--gate-chunks", type=int, default=3, help="chunks timed (first: warm-up)")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs of the pod (projection)")
    ap.add_argument("--pod-write-gbps", type=float, default=2.0, help="pod NVMe write, GB/s")
    ap.add_argument("--pod-read-gbps", type=float, default=3.0, help="pod NVMe read, GB/s")
    ap.add_argument("--h2d-gbps", type=float, default=5.0, help="host to GPU, pageable, GB/s")
    ap.add_argument("--gpu-tflops", type=float, default=989.0, help="H200 dense bf16 peak")
    ap.add_argument("--gpu-mfu", type=float, default=0.07, help="the user's plan's MFU")
    ap.add_argument("--round-every-s", type=float, default=3600.0)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny preset, 2 sources, a short window, all in this process")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, help="print a saved --json run's table again "
                    "(the projection with this call's assumptions); measures nothing")
    a = ap.parse_args(argv)
    if a.report:
        r = json.loads(a.report.read_text())
        r["stall"] = project(r, a)
        print(table(r, a) + "\n\n" + machine_line(r))
        return 0
    if a.smoke:
        a.preset, a.sources, a.window_tokens, a.gate_chunks, a.seq = "tiny", "2", 64, 2, 8
    a.sources = sorted({int(n) for n in a.sources.split(",")})
    if a.sources[0] < 2:
        ap.error("--sources: at least 2 checkpoints a merge")
    start = time.perf_counter()
    r = run(a)
    r["wall_s"] = time.perf_counter() - start
    print(table(r, a) + "\n\n" + machine_line(r))
    if a.json:
        common.write_json_atomic(a.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
