"""The merge round's gate measurement: a GPU's checkpoint and a round's merged weights, each
teacher-forced on that GPU's next window (tokens it has not trained on), from the same cold
state; optionally the AR probe of the merged weights at the same head. Deterministic, CPU
float32 unless told otherwise, nothing written. The launcher judges (launcher/checks/
merge_gate.py); this only measures. Run as `python -m fractus.eval.merge_gate ... --json`.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.data import ShardError, TokenShard
from fractus.eval.probe import ProbeConfig, probe_windows, run_probe
from fractus.legacy import as_engine_checkpoint, read_checkpoint
from fractus.train.merge_inbox import MERGED_FORMAT, learned_names

ROWS = 4


@torch.no_grad()
def window_tf(model: ContinuousThoughtEngine, rows: torch.Tensor, seq: int) -> float:
    """Mean teacher-forced CE over `rows` (R, n+1) from a cold state, `seq` tokens a chunk."""
    model.eval()
    model.reset_thought(rows.shape[0])
    total, count = 0.0, 0
    for i in range(0, rows.shape[1] - 1, seq):
        x, y = rows[:, i:i + seq], rows[:, i + 1:i + seq + 1]
        x = x[:, :y.shape[1]]
        logits = model.tick_chunk(x)
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                                 reduction="sum").item()
        count += y.numel()
    return total / count


def load_merged(path: str, model: ContinuousThoughtEngine) -> None:
    """The round file's parameters into `model`, in place (its constants stay as built)."""
    ck = read_checkpoint(path)
    if not isinstance(ck, dict) or ck.get("format") != MERGED_FORMAT:
        raise ValueError(f"{path} is not a {MERGED_FORMAT} file")
    own = learned_names(model)
    missing = sorted(set(own) - set(ck["params"]))
    if missing:
        raise ValueError(f"{path} lacks parameter(s) {missing[:3]}")
    with torch.no_grad():
        for name, param in own.items():
            param.copy_(ck["params"][name])


def measure(checkpoint: str, merged: str, shard_path: str, at: int, tokens: int, seq: int,
            probe: bool, device: str = "cpu") -> dict:
    ckpt = as_engine_checkpoint(read_checkpoint(checkpoint))
    model = ContinuousThoughtEngine.from_checkpoint(ckpt).to(device)
    shard = TokenShard(shard_path)
    per_row = max(tokens // ROWS, 2)
    start = at if at + per_row * ROWS + 1 <= len(shard) else max(0, len(shard) - per_row * ROWS - 1)
    window = shard.window(start, per_row * ROWS + 1).long()
    rows = torch.stack([window[r * per_row:(r + 1) * per_row + 1] for r in range(ROWS)]).to(device)
    carried = model.carry_state()       # the phases move in a pass: both start from these
    own_tf = window_tf(model, rows, seq)
    model.load_carry_state(carried)
    load_merged(merged, model)
    merged_tf = window_tf(model, rows, seq)
    result = {"own_tf": own_tf, "merged_tf": merged_tf, "start": start,
              "tokens": per_row * ROWS, "probe": None}
    if probe:
        cfg = ProbeConfig()
        p_start, span = probe_windows(len(shard), at, cfg)
        windows = shard.window(p_start, span * cfg.rows).long().view(cfg.rows, span)
        stats = run_probe(model, windows.to(device), cfg)
        result["probe"] = {**stats, "rows": cfg.rows, "start": p_start,
                           "vocab_size": model.config.vocab_size}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fractus.eval.merge_gate",
                                 description="a merge round's gate measurement for one GPU")
    ap.add_argument("--checkpoint", required=True, help="the GPU's checkpoint at the round")
    ap.add_argument("--merged", required=True, help="the round's merged weights")
    ap.add_argument("--shard", required=True)
    ap.add_argument("--at", type=int, required=True, help="the GPU's next token")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--probe", action="store_true", help="also the AR probe of the merged weights")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.at < 0 or args.tokens < 2 or args.seq < 1:
        print("error: --at must be >= 0, --tokens >= 2, --seq >= 1", file=sys.stderr)
        return 2
    try:
        result = measure(args.checkpoint, args.merged, args.shard, args.at, args.tokens,
                         args.seq, args.probe, args.device)
    except (ValueError, ShardError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
