"""Dense vs chunked cross-entropy (and sampling) on the tied 50257-way head.

Each cell runs in its own subprocess (benchmarks/common.run_cell: a crash or an OOM fills
its cell, not the table): forward + backward of the mean CE of `h @ W.T` over N = B*128
rows, for
- `dense`: `F.cross_entropy(h @ W.T, t)` with autograd (the reference);
- `chunked`: `fractus.nn.ce.chunked_cross_entropy(h, W, t, ce_chunk)`;
and (unless --no-sampler) one token per row from softmax(h @ W.T / 0.9): dense
`torch.multinomial` vs `sample_tokens_chunked`, no gradient.

Per cell: median seconds, and the EXTRA peak memory: peak RSS during the runs minus the
RSS once the inputs exist. Gradients are dropped before each run (as
zero_grad(set_to_none=True) does), so both forms pay for the h and W gradients they return:
"grads MB" says how much of the extra that is, "working MB" is the rest (extra - grads).
The cells run with glibc's MALLOC_MMAP_THRESHOLD_ fixed at 1 MiB (--glibc-default keeps
glibc's adaptive threshold):
every large buffer is then returned to the OS when freed, so RSS follows the live tensors.
With the adaptive threshold, freed buffers under 32 MiB (the chunked pieces) stay in the
heap and the RSS of a cell drifts up over its runs; the dense form's buffers (> 32 MiB) are
always returned, so the comparison would measure glibc, not the algorithm.

    python benchmarks/bench_ce.py                  # d=1280 (the 1B d_model), B in 2 4 8
    python benchmarks/bench_ce.py --d 128 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402  (imported here so every cell's base RSS includes it)
import torch.nn.functional as F  # noqa: E402

from benchmarks import common  # noqa: E402
from fractus.nn.ce import chunked_cross_entropy, sample_tokens_chunked  # noqa: E402

VOCAB = 50257
SEQ = 128
TEMPERATURE = 0.9
GOAL_ROWS = 1024  # the goals are stated at N = 1024 (B = 8)
GOAL_MEMORY_RATIO = 1 / 8  # chunked extra peak <= 1/8 of dense
GOAL_TIME_RATIO = 1.3  # chunked time <= 1.3x dense
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


# ----------------------------------------------------------------------------- one cell

def measure(kind: str, batch: int, d: int, ce_chunk: int, repeats: int, warmup: int) -> dict:
    """One cell, in its own process. kind: dense | chunked | sample-dense | sample-chunked."""
    rows = batch * SEQ
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, d, generator=g) / d ** 0.5).requires_grad_()
    W = (torch.randn(VOCAB, d, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, VOCAB, (rows,), generator=g)

    def train_step():
        h.grad = W.grad = None
        if kind == "dense":
            loss = F.cross_entropy(h @ W.T, targets)
        else:
            loss = chunked_cross_entropy(h, W, targets, ce_chunk)
        loss.backward()

    @torch.no_grad()
    def sample_step():
        if kind == "sample-dense":
            torch.multinomial(torch.softmax(h @ W.T / TEMPERATURE, dim=-1), 1)
        else:
            sample_tokens_chunked(h, W, TEMPERATURE, ce_chunk)

    sampling = kind.startswith("sample")
    gc.collect()
    memory = _PeakMemory()
    median_ms = common.median_ms(sample_step if sampling else train_step, repeats, warmup)
    grad_bytes = 0 if sampling else (h.numel() + W.numel()) * h.element_size()
    return {"kind": kind, "batch": batch, "rows": rows, "d": d,
            "ce_chunk": None if kind.endswith("dense") else ce_chunk,
            "median_s": median_ms / 1e3, "extra_peak_mb": memory.extra_peak_mb(),
            "grads_mb": grad_bytes / 2**20, "threads": torch.get_num_threads(),
            "peak_source": memory.source}


class _PeakMemory:
    """Peak RSS above the RSS at construction.

    Linux lets a process reset its own high-water mark (write 5 to /proc/self/clear_refs),
    so the peak excludes the import of torch and the allocation of the inputs; elsewhere
    the lifetime peak (ru_maxrss) is used: right only if nothing before peaked higher.
    """

    def __init__(self):
        import psutil
        self._process = psutil.Process()
        self.baseline = self._process.memory_info().rss
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.source = "VmHWM"
        except OSError:
            self.source = "ru_maxrss"

    def extra_peak_mb(self) -> float:
        if self.source == "VmHWM":
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10 - self.baseline / 2**20
        return common.peak_rss_mb() - self.baseline / 2**20


# ----------------------------------------------------------------------------- the table

def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _run_cells(args) -> list[dict]:
    kinds = [("dense", None)] + [("chunked", c) for c in args.ce_chunks]
    if args.sampler:
        kinds += [("sample-dense", None), ("sample-chunked", args.ce_chunks[0])]
    env = None if args.glibc_default else FIXED_MMAP_THRESHOLD
    results = []
    for batch in args.batches:
        for kind, ce_chunk in kinds:
            kwargs = dict(kind=kind, batch=batch, d=args.d, ce_chunk=ce_chunk or 0,
                          repeats=args.repeats, warmup=args.warmup)
            cell = common.run_cell("benchmarks.bench_ce", "measure", kwargs, args.timeout, env)
            cell.setdefault("kind", kind)
            cell.setdefault("batch", batch)
            cell.setdefault("ce_chunk", ce_chunk)
            results.append(cell)
            print(f"  {kind:>14} B={batch} ce_chunk={ce_chunk}: "
                  + (cell["error"] if "error" in cell else
                     f"{cell['median_s']:.3f} s, extra peak {cell['extra_peak_mb']:.0f} MB"),
                  file=sys.stderr, flush=True)
    return results


def _ratios(results: list[dict]) -> None:
    """Adds time_ratio / memory_ratio against the dense cell of the same batch and family."""
    for cell in results:
        family = "sample-" if cell["kind"].startswith("sample") else ""
        dense = next((c for c in results if c["kind"] == family + "dense"
                      and c["batch"] == cell["batch"] and "error" not in c), None)
        if dense is None or "error" in cell:
            continue
        cell["time_ratio"] = cell["median_s"] / dense["median_s"]
        cell["memory_ratio"] = cell["extra_peak_mb"] / dense["extra_peak_mb"]
        cell["working_ratio"] = ((cell["extra_peak_mb"] - cell["grads_mb"])
                                 / (dense["extra_peak_mb"] - dense["grads_mb"]))


def _table(cells: list[dict], with_grads: bool) -> str:
    headers = ["B", "N", "form", "ce_chunk", "median s", "extra peak MB"]
    headers += ["grads MB", "working MB"] if with_grads else []
    headers += ["time / dense", "memory / dense"]
    headers += ["working / dense"] if with_grads else []
    headers += ["load"]
    rows = []
    for c in cells:
        row = [c["batch"], c["batch"] * SEQ, c["kind"], common.fmt(c.get("ce_chunk"), "d")]
        if "error" in c:
            rows.append(row + [c["error"]] + [""] * (len(headers) - len(row) - 1))
            continue
        row += [common.fmt(c["median_s"], ".3f"), common.fmt(c["extra_peak_mb"], ".0f")]
        if with_grads:
            row += [common.fmt(c["grads_mb"], ".0f"),
                    common.fmt(c["extra_peak_mb"] - c["grads_mb"], ".0f")]
        row += [common.fmt(c.get("time_ratio"), ".2f"), common.fmt(c.get("memory_ratio"), ".3f")]
        row += [common.fmt(c.get("working_ratio"), ".3f")] if with_grads else []
        row += ["/".join(str(x) for x in c.get("load_avg", []))]
        rows.append(row)
    return common.markdown_table(headers, rows)


def _goal_lines(results: list[dict]) -> list[str]:
    lines = []
    for c in results:
        if c["kind"] != "chunked" or c["batch"] * SEQ != GOAL_ROWS or "time_ratio" not in c:
            continue
        memory_ok = c["memory_ratio"] <= GOAL_MEMORY_RATIO
        time_ok = c["time_ratio"] <= GOAL_TIME_RATIO
        lines.append(
            f"- N={GOAL_ROWS}, ce_chunk={c['ce_chunk']}: extra peak {c['memory_ratio']:.3f} of "
            f"dense (goal <= {GOAL_MEMORY_RATIO:.3f}) {'PASS' if memory_ok else 'FAIL'}; "
            f"time {c['time_ratio']:.2f}x dense (goal <= {GOAL_TIME_RATIO}x) "
            f"{'PASS' if time_ok else 'FAIL'}; without the h/W gradients both must return: "
            f"{c['working_ratio']:.3f} of dense")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=_ints, default=[2, 4, 8], help="comma list (N = B*128)")
    ap.add_argument("--d", type=int, default=1280, help="hidden size (1280: the 1B d_model)")
    ap.add_argument("--ce-chunks", type=_ints, default=[2048, 512, 128],
                    help="comma list of chunked CE piece sizes, in rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per cell")
    ap.add_argument("--no-sampler", dest="sampler", action="store_false",
                    help="skip the multinomial vs sample_tokens_chunked cells")
    ap.add_argument("--glibc-default", action="store_true",
                    help="keep glibc's adaptive mmap threshold in the cells (see module doc)")
    ap.add_argument("--json", type=Path, help="also write all cells here")
    args = ap.parse_args()

    results = _run_cells(args)
    _ratios(results)
    print(f"\nCross-entropy fwd+bwd, V={VOCAB}, d={args.d}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, "
          f"{'adaptive' if args.glibc_default else 'fixed 1 MiB'} glibc mmap threshold\n")
    print(_table([c for c in results if not c["kind"].startswith("sample")], with_grads=True))
    if args.sampler:
        print(f"\nSampling one token per row at T={TEMPERATURE} (no gradient)\n")
        print(_table([c for c in results if c["kind"].startswith("sample")], with_grads=False))
    goals = _goal_lines(results)
    if goals:
        print("\nGoals (issue 2):\n" + "\n".join(goals))
    if args.json:
        common.write_json_atomic(args.json, {"d": args.d, "vocab": VOCAB, "cells": results})


if __name__ == "__main__":
    main()
