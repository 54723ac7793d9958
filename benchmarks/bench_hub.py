"""Checkpoint store throughput against the test hub on loopback, and the merge's peak memory.

    python benchmarks/bench_hub.py [--size-mb 1024] [--merge-gpus 8 --merge-size-mb 256]

Hub part: one file of --size-mb random bytes is pushed through `hf://` (HfApi: sha256, LFS
batch, PUT, verify, one commit) to the test hub running in its own process, then pulled into
an empty pod (HEAD, GET, sha256 check, fsync, rename). Both are set next to a plain
`shutil.copyfile` of the same bytes (and a copy + fsync, the durable copy a pull also makes),
and next to sha256 alone: every verified transfer hashes the bytes at least once.

Merge part: --merge-gpus synthetic float32 checkpoints of --merge-size-mb each are merged in
a child process whose RSS is sampled every 2 ms; the peak above its RSS after imports is
reported in units of one checkpoint (goal: about two, not N+1). RSS counts the mapped
checkpoint pages that have been read, so the mmap streaming is measured, not assumed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_TOKEN = "hf_bench_only_not_a_secret"
# The test hub speaks plain LFS: use the client's documented switch before it is imported.
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["HF_TOKEN"] = BENCH_TOKEN
sys.path.insert(0, str(REPO_ROOT))

MB = 1 << 20


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _random_file(path: Path, size_mb: int) -> None:
    block = os.urandom(16 * MB)
    with open(path, "wb") as f:
        for i in range(0, size_mb, 16):
            n = min(16, size_mb - i) * MB
            # Vary each block so no layer below can deduplicate or compress it away.
            f.write(hashlib.sha256(i.to_bytes(8, "little")).digest() + block[32:n])


def _copy_durable(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    with open(dst, "rb+") as f:
        os.fsync(f.fileno())


def _start_hub(root: Path) -> tuple[subprocess.Popen, str]:
    url_file = root / "url"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.hub_server", "--root", str(root / "data"),
         "--token", BENCH_TOKEN, "--url-file", str(url_file)],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        if url_file.exists():
            return proc, url_file.read_text()
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("test hub did not start")


def bench_hub(size_mb: int, work: Path) -> None:
    from launcher.hub import open_store

    pod = work / "pod"
    rel = "checkpoints/fractus_1b_gpu0.pt"
    src = pod / rel
    src.parent.mkdir(parents=True)
    _random_file(src, size_mb)

    t_copy = _timed(lambda: shutil.copyfile(src, work / "copy.bin"))
    t_copy_sync = _timed(lambda: _copy_durable(src, work / "copy_sync.bin"))
    t_hash = _timed(lambda: hashlib.file_digest(open(src, "rb"), "sha256"))
    (work / "copy.bin").unlink()
    (work / "copy_sync.bin").unlink()

    proc, url = _start_hub(work / "hub")
    try:
        store = open_store("hf://bench/run", pod, endpoint=url)
        t_push = _timed(lambda: store.push([rel], "bench push"))
        fresh = work / "fresh_pod"
        t_pull = _timed(lambda: open_store("hf://bench/run", fresh, endpoint=url).pull([rel]))
        assert (fresh / rel).stat().st_size == size_mb * MB
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    def rate(t: float) -> float:
        return size_mb / t

    print(f"hub throughput, {size_mb} MB file, test hub on loopback ({os.cpu_count()} CPUs)")
    print(f"  shutil.copyfile        {rate(t_copy):8.0f} MB/s   ({t_copy:.2f} s)")
    print(f"  copy + fsync           {rate(t_copy_sync):8.0f} MB/s   ({t_copy_sync:.2f} s)")
    print(f"  sha256 alone           {rate(t_hash):8.0f} MB/s   ({t_hash:.2f} s)")
    print(f"  push (hf://, 1 commit) {rate(t_push):8.0f} MB/s   ({t_push:.2f} s)"
          f"   = {t_copy / t_push:.2f} x copy, {t_copy_sync / t_push:.2f} x copy+fsync")
    print(f"  pull (verified)        {rate(t_pull):8.0f} MB/s   ({t_pull:.2f} s)"
          f"   = {t_copy / t_pull:.2f} x copy, {t_copy_sync / t_pull:.2f} x copy+fsync")


_MERGE_CHILD = """
import sys, threading, time
import psutil, torch
from launcher.merge import merge_checkpoints
proc = psutil.Process()
before = proc.memory_info().rss
peak, done = before, threading.Event()
def sample():
    global peak
    while not done.is_set():
        peak = max(peak, proc.memory_info().rss)
        time.sleep(0.002)
sampler = threading.Thread(target=sample)
sampler.start()
merge_checkpoints(sys.argv[2:], sys.argv[1])
done.set()
sampler.join()
print(before, max(peak, proc.memory_info().rss))
"""


def _merge_peak(out: Path, paths: list[str]) -> tuple[int, int]:
    """(RSS after imports, peak RSS during the merge), sampled in a child process, in bytes."""
    res = subprocess.run([sys.executable, "-c", _MERGE_CHILD, str(out), *paths], cwd=REPO_ROOT,
                         check=True, capture_output=True, text=True)
    before, peak = res.stdout.split()[-2:]
    return int(before), int(peak)


def bench_merge(n_gpus: int, size_mb: int, work: Path) -> None:
    import torch

    # A few large tensors (like the embedding and expert stacks), a tied head, carried state.
    rows = size_mb * MB // 4 // 1024 // 4
    paths = []
    for gpu in range(n_gpus):
        emb = torch.randn(rows, 1024)
        state = {
            "observe.weight": emb, "output_head.weight": emb,
            "blocks.0.moe.w1": torch.randn(rows, 1024), "blocks.0.moe.w2": torch.randn(rows, 1024),
            "blocks.0.attn.w_out": torch.randn(rows, 1024),
            "thought_state": torch.randn(4, 1, 1024), "blocks.0.attn_S": torch.randn(4, 64, 64),
            "step": torch.tensor(gpu),
        }
        path = work / f"fractus_1b_gpu{gpu}.pt"
        torch.save({"model_state": state, "config": {"gpu": gpu}}, path)
        paths.append(str(path))
        del state, emb
    ckpt_mb = os.path.getsize(paths[0]) / MB
    start = time.perf_counter()
    before, peak = _merge_peak(work / "merged.pt", paths)
    elapsed = time.perf_counter() - start
    above_mb = (peak - before) / MB
    print(f"merge of {n_gpus} checkpoints of {ckpt_mb:.0f} MB: {elapsed:.1f} s (incl. process start); "
          f"RSS {before / MB:.0f} MB after imports, peak {peak / MB:.0f} MB: +{above_mb:.0f} MB "
          f"= {above_mb / ckpt_mb:.2f} checkpoints (all N in memory would be {n_gpus + 1})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="size of the pushed/pulled file")
    parser.add_argument("--merge-gpus", type=int, default=8)
    parser.add_argument("--merge-size-mb", type=int, default=256, help="size of each merged checkpoint")
    parser.add_argument("--only", choices=["hub", "merge"], default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="scratch space (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        if args.only in (None, "hub"):
            (work / "hub_bench").mkdir()
            bench_hub(args.size_mb, work / "hub_bench")
            shutil.rmtree(work / "hub_bench")
        if args.only in (None, "merge"):
            (work / "merge_bench").mkdir()
            bench_merge(args.merge_gpus, args.merge_size_mb, work / "merge_bench")
    print(f"(benchmark process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")


if __name__ == "__main__":
    main()
