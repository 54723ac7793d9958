"""A pod pushing faster than the hub takes commits: the waits, the early retries, the pushes
lost, against the test hub's quota (tests/support/hub_server.py `rate_limits`: 429 with
`Retry-After` and `RateLimit` headers past `--limit` commits per `--window-s`).

    python benchmarks/bench_hub_rate_limit.py [--limit 5 --window-s 60 --every-s 5 --minutes 3]
    python benchmarks/bench_hub_rate_limit.py --as-transient   # 429 as any 5xx (the old way)

One push (a 4 KiB checkpoint, one commit) is started every --every-s seconds (the sync's
interval; each waits for the one before) through the real HfApi and `HfStore`, with the
sync's default retry policy (5 attempts, 1 s doubling). Reported: pushes landed and given
up, commit requests and 429s, requests the hub saw before the Retry-After of the 429 they
followed ("early"), commit requests per minute. `--as-transient` replays the store as it
was before rate limits were honoured: a 429 retried like a 5xx, 1, 2, 4, 8 s, then given up.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_TOKEN"] = "hf_bench_only_not_a_secret"
sys.path.insert(0, str(REPO_ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--every-s", type=float, default=5.0)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--as-transient", action="store_true")
    args = parser.parse_args()

    from huggingface_hub import constants
    constants.HF_HUB_DISABLE_XET = True
    from launcher.hub import HubError, RetryPolicy, open_store
    from launcher.hub import retry
    from tests.support.hub_server import HubServer

    if args.as_transient:
        retry.rate_limited_wait = lambda exc: (False, None)
    with tempfile.TemporaryDirectory() as tmp, HubServer(Path(tmp) / "hub") as hub:
        os.environ["HF_ENDPOINT"] = hub.url
        pod = Path(tmp) / "pod"
        (pod / "checkpoints").mkdir(parents=True)
        store = open_store("hf://bench/rate", pod, retry=RetryPolicy())
        ckpt = pod / "checkpoints" / "fractus_1b_gpu0.pt"
        ckpt.write_bytes(os.urandom(4096))
        store.push(["checkpoints/fractus_1b_gpu0.pt"], "first")   # the repo, before the quota
        hub.rate_limits.set("commit", args.limit, args.window_s, method="POST")
        posts_before = len(hub.routed("commit", "POST"))
        landed = lost = 0
        start = time.monotonic()
        next_at = start
        while time.monotonic() - start < args.minutes * 60:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += args.every_s
            ckpt.write_bytes(os.urandom(4096))
            try:
                store.push(["checkpoints/fractus_1b_gpu0.pt"], "push")
                landed += 1
            except HubError:
                lost += 1
            next_at = max(next_at, time.monotonic())
        minutes = (time.monotonic() - start) / 60
        posts = len(hub.routed("commit", "POST")) - posts_before
        print(f"{'429 as transient (before)' if args.as_transient else 'rate limits honoured'}: "
              f"quota {args.limit}/{args.window_s:g}s, a push every {args.every_s:g}s, "
              f"{minutes:.1f} min: pushes landed {landed}, given up {lost}; commit requests "
              f"{posts} ({posts / minutes:.1f}/min), 429s {hub.rate_limits.answered_429}, "
              f"early {hub.rate_limits.early}")


if __name__ == "__main__":
    main()
