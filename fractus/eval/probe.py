"""The trusted-loss AR probe: does the model still generate, not only teacher-force?

Protocol: shared/spec/MODEL.md, "Trusted loss". Rows are consecutive windows from the train
head (not yet trained on), or ending there near the shard's end; the spread of each row's
AR (`ar_rows`) is the noise the launcher calibrates on (docs/CANARY.md). Deterministic: no
sampling, float32 on the CPU unless told otherwise. Files that record no head need --head
or --default-head; files without a config, --model.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from fractus.config import EngineConfig, load_model_config
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.data import ShardError, TokenShard
from fractus.legacy import as_engine_checkpoint, describe_filled, read_checkpoint, train_head


@dataclass(frozen=True)
class ProbeConfig:
    warm: int = 32
    free: int = 32
    cold: int = 128
    rows: int = 4
    gate_temp: float = 2.5


@dataclass(frozen=True)
class ProbeResult:
    ar: float          # mean CE of the free-run predictions against the true tokens
    ar_acc: float      # argmax match rate during the free run
    cold_tf: float     # teacher-forced CE of a cold state on a `cold`-token chunk
    start: int         # first shard position used
    rows: int
    next_token: int | None   # the train head the checkpoint records (None: it records none)
    ar_rows: tuple[float, ...] = ()   # each row's AR (window-to-window noise)
    vocab_size: int | None = None     # V: uniform guessing scores ln(V)
    filled: str | None = None         # what the load filled from the model's construction


def probe_windows(shard_len: int, head: int, cfg: ProbeConfig) -> tuple[int, int]:
    """(start, span): `rows` windows of `span` tokens at the head, or ending at it."""
    span = max(cfg.warm + cfg.free, cfg.cold) + 1
    need = span * cfg.rows
    if need > shard_len:
        raise ValueError(f"shard of {shard_len} tokens is too short for {cfg.rows} probe rows "
                         f"of {span} tokens")
    start = head if head + need <= shard_len else max(0, head - need)
    return start, span


@torch.no_grad()
def run_probe(model: ContinuousThoughtEngine, windows: torch.Tensor, cfg: ProbeConfig) -> dict:
    """windows (rows, span) int64 true tokens -> {"ar", "ar_acc", "cold_tf", "ar_rows"}."""
    model.eval()
    model.set_gate_temperature(cfg.gate_temp)
    rows = windows.shape[0]

    model.reset_thought(rows)
    logits = model.tick_chunk(windows[:, :cfg.warm])[:, -1]
    losses, hits = [], []
    for t in range(cfg.free):
        truth = windows[:, cfg.warm + t]
        losses.append(F.cross_entropy(logits.float(), truth, reduction="none"))
        guess = logits.argmax(dim=-1)
        hits.append((guess == truth).float())
        logits = model.tick_chunk(guess.unsqueeze(1))[:, -1]

    model.reset_thought(rows)
    cold_logits = model.tick_chunk(windows[:, :cfg.cold])
    cold = F.cross_entropy(cold_logits.reshape(-1, cold_logits.shape[-1]).float(),
                           windows[:, 1:cfg.cold + 1].reshape(-1))
    per_step = torch.stack(losses)             # (free, rows)
    return {"ar": per_step.mean().item(), "ar_acc": torch.stack(hits).mean().item(),
            "cold_tf": cold.item(), "ar_rows": tuple(per_step.mean(dim=0).tolist())}


def probe_checkpoint(checkpoint, shard_path, cfg: ProbeConfig = ProbeConfig(),
                     head: int | None = None, device: str = "cpu",
                     model_config: EngineConfig | None = None,
                     default_head: int | None = None) -> ProbeResult:
    """Probe a checkpoint (path or dict) at `head`, else its recorded train head, else
    `default_head`; `model_config` builds a file that carries no config."""
    ckpt = as_engine_checkpoint(read_checkpoint(checkpoint), model_config)
    next_token = train_head(ckpt)
    head = next_token if head is None else head
    head = default_head if head is None else head
    if head is None:
        raise ValueError("no train head: the checkpoint records none (train_state.next_token, "
                         "or v1's config.tokens_processed); pass --head")
    shard = TokenShard(shard_path)
    start, span = probe_windows(len(shard), int(head), cfg)
    windows = shard.window(start, span * cfg.rows).long().view(cfg.rows, span)
    model = ContinuousThoughtEngine.from_checkpoint(ckpt).to(device)  # run_probe resets the state
    stats = run_probe(model, windows.to(device), cfg)
    return ProbeResult(start=start, rows=cfg.rows, next_token=next_token,
                       vocab_size=model.config.vocab_size,
                       filled=describe_filled(getattr(model, "filled_on_load", []), model),
                       **stats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fractus.eval.probe", description="AR probe of a checkpoint")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--shard", required=True)
    ap.add_argument("--head", type=int, help="train head (default: the one the checkpoint records)")
    ap.add_argument("--default-head", type=int,
                    help="train head when the checkpoint records none (the merged brain)")
    ap.add_argument("--model", help="preset or .json/.yaml config for a checkpoint that carries "
                                    "none (a bare state_dict)")
    ap.add_argument("--rows", type=int, default=ProbeConfig.rows)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        model_config = load_model_config(args.model) if args.model else None
        result = probe_checkpoint(args.checkpoint, args.shard, ProbeConfig(rows=args.rows),
                                  args.head, args.device, model_config, args.default_head)
    except (ValueError, ShardError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print(f"AR={result.ar:.4f} ARacc={result.ar_acc:.3f} cold_tf={result.cold_tf:.4f} "
              f"(rows={result.rows}, start={result.start})")
        if result.filled:
            print(result.filled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
