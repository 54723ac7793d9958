"""Linear-attention kernels at the Fractus-1B shapes: time and peak memory per kernel and batch.

Shapes: G = B * 40 groups (B rows x 2 levels x 20 heads), C = 128 positions, d_head D = 64,
carried state on. For every kernel and batch, in its own subprocess (a crash or an OOM fills
that cell, not the table): median forward ms, median forward+backward ms (random upstream
gradients on y, S and z), and the cell's peak RSS (and peak CUDA memory on a GPU).

    python benchmarks/bench_attention.py                          # CPU, float32, B in 1 2 4 8
    python benchmarks/bench_attention.py --impls einsum,chunked --batches 4,8 --repeats 3
    python benchmarks/bench_attention.py --device cuda --dtype bfloat16 --json out.json

The goals (issue 2), computed at the end when the cells exist: chunked fwd+bwd at B=4 at
least 25x faster than einsum; peak RSS of chunked at B=8 under a quarter of einsum at B=4.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402  (imported here so every cell's base RSS includes it)

from benchmarks import common  # noqa: E402
from fractus.nn import attention  # noqa: E402

GROUPS_PER_ROW = 2 * 20  # levels x heads of the 1B model
CHUNK = 128
D_HEAD = 64
GOAL_SPEEDUP = 25.0  # einsum / chunked fwd+bwd at B=4
GOAL_RSS_RATIO = 0.25  # chunked B=8 / einsum B=4 peak RSS


def measure(impl: str, batch: int, repeats: int = 5, warmup: int = 1, device: str = "cpu",
            dtype: str = "float32") -> dict:
    """One cell (runs in its own process): median fwd and fwd+bwd ms of one kernel."""
    torch.manual_seed(0)
    G = batch * GROUPS_PER_ROW
    low = getattr(torch, dtype)

    def make(*shape, positive=False):
        t = torch.randn(*shape, device=device)  # in place below: no temporaries in the peak
        return torch.nn.functional.elu_(t).add_(1) if positive else t

    # q, k, v in the run dtype (what the projections give under autocast); carry in float32.
    q = make(G, CHUNK, D_HEAD, positive=True).to(low).requires_grad_()
    k = make(G, CHUNK, D_HEAD, positive=True).to(low).requires_grad_()
    v = make(G, CHUNK, D_HEAD).to(low).requires_grad_()
    S0 = make(G, D_HEAD, D_HEAD).mul_(0.1).requires_grad_()
    z0 = make(G, D_HEAD).abs_().requires_grad_()
    upstream = None

    def forward():
        with torch.autocast(device_type=device, dtype=low, enabled=low != torch.float32):
            return attention.linear_attention(q, k, v, (S0, z0), impl=impl)

    def forward_backward():
        nonlocal upstream
        y, (S, z) = forward()
        if upstream is None:
            upstream = [torch.randn_like(t) for t in (y, S, z)]
        torch.autograd.backward((y, S, z), upstream)
        for t in (q, k, v, S0, z0):
            t.grad = None

    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    fwd = common.time_ms(forward, repeats, warmup, sync)
    fwdbwd = common.time_ms(forward_backward, repeats, warmup, sync)
    result = {"impl": impl, "batch": batch, "groups": G, "device": device, "dtype": dtype,
              "fwd_ms": statistics.median(fwd), "fwdbwd_ms": statistics.median(fwdbwd),
              "fwd_times_ms": fwd, "fwdbwd_times_ms": fwdbwd,
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def _csv(kind):
    def parse(text):
        try:
            items = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        if not items:
            raise argparse.ArgumentTypeError("expected at least one value")
        return items
    return parse


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", type=_csv(str), default=list(attention.ATTENTION_IMPLS))
    p.add_argument("--batches", type=_csv(int), default=[1, 2, 4, 8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    p.add_argument("--json", type=Path, help="also write every cell and the summary here")
    p.add_argument("--child-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable for every cell, e.g. MALLOC_MMAP_THRESHOLD_=131072 "
                        "(freed tensors go back to the OS: RSS then tracks live memory)")
    args = p.parse_args(argv)
    if any("=" not in item for item in args.child_env):
        p.error("--child-env expects NAME=VALUE")
    args.child_env = dict(item.split("=", 1) for item in args.child_env)
    unknown = [i for i in args.impls if i not in attention.ATTENTION_IMPLS]
    if unknown:
        p.error(f"unknown impl(s) {', '.join(unknown)}; expected one of: "
                f"{', '.join(attention.ATTENTION_IMPLS)}")
    if any(b < 1 for b in args.batches) or args.repeats < 1 or args.warmup < 0:
        p.error("batches and repeats must be >= 1, warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    return args


def summarise(cells: list) -> dict:
    """The two goal ratios, where the cells they need exist.

    Besides the goal's peak-RSS ratio, the ratio of peaks above each cell's base RSS (the
    interpreter and torch, about 220 MB, the same in every cell) says what the kernels cost.
    """
    by = {(c.get("impl"), c.get("batch")): c for c in cells if "error" not in c}
    einsum4 = by.get(("einsum", 4))
    chunked4, chunked8 = by.get(("chunked", 4)), by.get(("chunked", 8))
    out = {}
    if einsum4 and chunked4:
        speedup = einsum4["fwdbwd_ms"] / chunked4["fwdbwd_ms"]
        out.update(speedup_fwdbwd_einsum_over_chunked_B4=speedup,
                   speedup_goal_met=speedup >= GOAL_SPEEDUP)
    if einsum4 and chunked8:
        ratio = chunked8["peak_rss_mb"] / einsum4["peak_rss_mb"]
        extra = ((chunked8["peak_rss_mb"] - chunked8["base_rss_mb"])
                 / (einsum4["peak_rss_mb"] - einsum4["base_rss_mb"]))
        out.update(rss_chunked_B8_over_einsum_B4=ratio, rss_goal_met=ratio < GOAL_RSS_RATIO,
                   rss_above_base_chunked_B8_over_einsum_B4=extra)
    return out


def _print_summary(summary: dict) -> None:
    verdict = {True: "met", False: "NOT met"}
    if "speedup_goal_met" in summary:
        print(f"\neinsum / chunked fwd+bwd at B=4: "
              f"{summary['speedup_fwdbwd_einsum_over_chunked_B4']:.1f}x "
              f"(goal >= {GOAL_SPEEDUP:.0f}x: {verdict[summary['speedup_goal_met']]})")
    if "rss_goal_met" in summary:
        print(f"peak RSS chunked B=8 / einsum B=4: {summary['rss_chunked_B8_over_einsum_B4']:.3f} "
              f"(goal < {GOAL_RSS_RATIO}: {verdict[summary['rss_goal_met']]}); above each "
              f"cell's base RSS: {summary['rss_above_base_chunked_B8_over_einsum_B4']:.3f}")


def main(argv=None) -> int:
    args = _parse_args(argv)
    cells = []
    for impl in args.impls:
        for batch in args.batches:
            print(f"[bench_attention] {impl} B={batch} ...", file=sys.stderr, flush=True)
            kwargs = dict(impl=impl, batch=batch, repeats=args.repeats, warmup=args.warmup,
                          device=args.device, dtype=args.dtype)
            cell = common.run_cell("benchmarks.bench_attention", "measure", kwargs, args.timeout,
                                   env=args.child_env)
            cells.append({"impl": impl, "batch": batch, **cell})

    cuda = args.device == "cuda"
    headers = ["impl", "B", "G", "fwd ms", "fwd+bwd ms", "peak RSS MB", "above base MB"] + (
        ["peak CUDA MB"] if cuda else [])
    rows = []
    for c in cells:
        if "error" in c:
            blanks = [""] * (len(headers) - 4)
            rows.append([c["impl"], c["batch"], c["batch"] * GROUPS_PER_ROW, c["error"]] + blanks)
            continue
        rows.append([c["impl"], c["batch"], c["groups"], common.fmt(c["fwd_ms"]),
                     common.fmt(c["fwdbwd_ms"]), common.fmt(c["peak_rss_mb"], ".0f"),
                     common.fmt(c["peak_rss_mb"] - c["base_rss_mb"], ".0f")]
                    + ([common.fmt(c["peak_cuda_mb"], ".0f")] if cuda else []))
    first = next((c for c in cells if "torch" in c), {})
    loads = [x for c in cells for x in c.get("load_avg", [])]
    load = f", 1-min load average {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    print(f"\nLinear attention, G = B*{GROUPS_PER_ROW}, C={CHUNK}, D={D_HEAD}, carry on, "
          f"{args.device} {args.dtype}, torch {first.get('torch', '?')}, "
          f"{first.get('threads', '?')} threads, median of {args.repeats}{load}"
          + "".join(f", {k}={v}" for k, v in args.child_env.items()) + "\n")
    print(common.markdown_table(headers, rows))

    summary = summarise(cells)
    _print_summary(summary)
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        common.write_json_atomic(args.json, {"config": config, "cells": cells, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
