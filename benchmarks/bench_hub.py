"""Checkpoint store throughput against the test hub on loopback, and the merge's peak memory.

    python benchmarks/bench_hub.py [--size-mb 1024 --rounds 3] [--merge-gpus 8 --merge-size-mb 256]

Hub part: one file of --size-mb random bytes is pushed through `hf://` (HfApi: LFS batch,
PUT, verify, one commit) to the test hub running in its own process, then pulled into an
empty pod (HEAD, GET, sha256 check, fsync, rename). Side by side, in interleaved rounds:
a plain `shutil.copyfile` of the same bytes, a copy + fsync (the durable copy a pull also
makes), sha256 alone (every verified transfer hashes each byte at least once), and the
client's bare transport: one PUT and one GET of the same bytes through huggingface_hub's own
HTTP session with no hashing or commit, the floor under any transfer through the client.
The push is the sync's: each file hashed once (LFS names objects by sha256), checked against
the checkpoint's recorded sha256 before any byte is sent, then uploaded and committed.

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


def _mark(path: Path, tag: int) -> str:
    """Give the file new bytes (its first 8) so the hub cannot deduplicate it; its sha256."""
    with open(path, "r+b") as f:
        f.write(tag.to_bytes(8, "little"))
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _client_get(url: str, dest: Path) -> None:
    """The bytes of one file through huggingface_hub's own HTTP session, written, no checks:
    what any download through the client costs at least."""
    from huggingface_hub.utils import build_hf_headers, get_session
    with get_session().stream("GET", url, headers=build_hf_headers()) as response, \
            open(dest, "wb") as f:
        response.raise_for_status()
        for chunk in response.iter_bytes(10 * MB):
            f.write(chunk)


def _client_put(url: str, src: Path) -> None:
    """One LFS upload through the client's HTTP session, as `preupload_lfs_files` sends it."""
    from huggingface_hub.utils import build_hf_headers, get_session
    with open(src, "rb") as f:
        get_session().put(url, content=f, headers=build_hf_headers()).raise_for_status()


def bench_hub(size_mb: int, work: Path, rounds: int) -> None:
    """Every measurement once per round, interleaved, so page-cache and machine noise fall on
    all of them alike; the median of the rounds is reported."""
    from launcher.hub import open_store

    pod = work / "pod"
    rel = "checkpoints/fractus_1b_gpu0.pt"
    src = pod / rel
    src.parent.mkdir(parents=True)
    _random_file(src, size_mb)
    times: dict[str, list[float]] = {}

    def measure(name: str, fn) -> None:
        times.setdefault(name, []).append(_timed(fn))

    proc, url = _start_hub(work / "hub")
    try:
        store = open_store("hf://bench/run", pod, endpoint=url)
        store.push([rel], "bench: create the repo")
        for r in range(rounds):
            measure("shutil.copyfile", lambda: shutil.copyfile(src, work / "copy.bin"))
            measure("copy + fsync", lambda: _copy_durable(src, work / "copy_sync.bin"))
            measure("sha256 alone", lambda: hashlib.file_digest(open(src, "rb"), "sha256"))
            (work / "copy.bin").unlink()
            (work / "copy_sync.bin").unlink()

            oid = _mark(src, 3 * r + 1)   # raw client transport: no hashing, no commit
            measure("client PUT, bytes only", lambda: _client_put(f"{url}/_lfs/{oid}", src))
            sha = _mark(src, 3 * r + 2)   # the sync's push: checked against its recorded hash
            measure("push (one commit)",
                    lambda: store.push([rel], "bench push", expected={rel: sha}))
            rev = store.head()
            measure("client GET, bytes only",
                    lambda: _client_get(f"{url}/bench/run/resolve/{rev}/{rel}", work / "get.bin"))
            (work / "get.bin").unlink()
            fresh = work / "fresh_pod"
            measure("pull (verified, durable)",
                    lambda: open_store("hf://bench/run", fresh, endpoint=url).pull([rel]))
            assert (fresh / rel).stat().st_size == size_mb * MB
            shutil.rmtree(fresh)
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    median = {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}
    copy, durable = median["shutil.copyfile"], median["copy + fsync"]
    print(f"hub throughput, {size_mb} MB file, test hub on loopback ({os.cpu_count()} CPUs), "
          f"median of {rounds} interleaved rounds")
    print(f"  {'':28s} {'MB/s':>7s} {'s':>6s} {'x copy':>7s} {'x copy+fsync':>13s}   all rounds (s)")
    for name, t in median.items():
        rounds_s = " ".join(f"{x:.2f}" for x in times[name])
        print(f"  {name:28s} {size_mb / t:7.0f} {t:6.2f} {copy / t:7.2f} {durable / t:13.2f}"
              f"   {rounds_s}")


_MERGE_CHILD = """
import sys, threading, time
import psutil, torch
from launcher.hub.merge import merge_checkpoints
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
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the hub part")
    parser.add_argument("--merge-gpus", type=int, default=8)
    parser.add_argument("--merge-size-mb", type=int, default=256, help="size of each merged checkpoint")
    parser.add_argument("--only", choices=["hub", "merge"], default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="scratch space (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        work = Path(tmp)
        if args.only in (None, "hub"):
            (work / "hub_bench").mkdir()
            bench_hub(args.size_mb, work / "hub_bench", args.rounds)
            shutil.rmtree(work / "hub_bench")
        if args.only in (None, "merge"):
            (work / "merge_bench").mkdir()
            bench_merge(args.merge_gpus, args.merge_size_mb, work / "merge_bench")
    print(f"(benchmark process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")


if __name__ == "__main__":
    main()
