"""Retaining a checkpoint while its worker keeps rotating the names (checkpoints/name,
name.1, ... name.8): a node that reads its worker's lines late sees the file of an event
move from name.k to name.k+1 while it looks. The launcher must neither crash (it did:
FileNotFoundError out of the supervisor's poll on a Ray node) nor retain other bytes."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from pathlib import Path

from launcher.pod.ckpt_index import CheckpointIndex

KEEP = 9                         # name plus name.1 .. name.8, as the candidates go


def rotate_and_save(ckpt: Path, payload: bytes, keep: int = KEEP) -> None:
    """The worker's save: shift name.k -> name.k+1, then the new file under `name`."""
    for k in range(keep - 1, 0, -1):
        older = ckpt.with_name(f"{ckpt.name}.{k - 1}") if k > 1 else ckpt
        if older.exists():
            os.replace(older, ckpt.with_name(f"{ckpt.name}.{k}"))
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    tmp.write_bytes(payload)
    os.replace(tmp, ckpt)


def test_retaining_while_the_worker_rotates_never_crashes_nor_keeps_other_bytes(tmp_path):
    pod = tmp_path / "pod"
    ckpt = pod / "checkpoints" / "fractus_1b_gpu0.pt"
    ckpt.parent.mkdir(parents=True)
    events: queue.Queue = queue.Queue(maxsize=3)   # the reader lags 1-4 saves behind
    stop = threading.Event()

    def worker():
        n = 0
        while not stop.is_set():
            payload = f"checkpoint {n} ".encode() * 64
            rotate_and_save(ckpt, payload)
            event = {"sha256": hashlib.sha256(payload).hexdigest(), "next_token": n,
                     "step": n, "bytes": len(payload)}
            while not stop.is_set():
                try:
                    events.put(event, timeout=0.1)
                    break
                except queue.Full:
                    continue
            n += 1

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    index = CheckpointIndex(pod)
    records = []
    try:
        while len(records) < 400:
            event = events.get(timeout=30)
            records.append(index.add(0, event, stage=1, path="checkpoints/fractus_1b_gpu0.pt"))
    finally:
        stop.set()
        thread.join(timeout=30)
    retained = [r for r in records if r["retained"]]
    for record in retained:
        data = (pod / record["retained"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == record["sha256"], record
    assert len(retained) > len(records) // 2      # most events still find their bytes
    assert not list((pod / "checkpoints").rglob("*.pin"))


def test_an_event_read_many_saves_late_finds_its_bytes_as_far_down_as_save_keep_goes(tmp_path):
    """A node whose poll stalled (a loaded head, an actor starting): the event of a save is
    read after 20 more saves, with SAVE_KEEP 30 its bytes are at name.20. They are retained
    (CI once probed such a checkpoint on a Ray node: "not retained", no verdict); past
    SAVE_KEEP nothing is, and nothing else is kept in its place."""
    pod = tmp_path / "pod"
    ckpt = pod / "checkpoints" / "fractus_1b_gpu0.pt"
    ckpt.parent.mkdir(parents=True)
    payloads = [f"checkpoint {n} ".encode() * 64 for n in range(40)]
    for payload in payloads[:21]:
        rotate_and_save(ckpt, payload, keep=30)
    index = CheckpointIndex(pod)
    event = {"sha256": hashlib.sha256(payloads[0]).hexdigest(), "next_token": 0, "step": 0,
             "bytes": len(payloads[0])}
    record = index.add(0, event, stage=1, path="checkpoints/fractus_1b_gpu0.pt")
    assert record["retained"] and (pod / record["retained"]).read_bytes() == payloads[0]
    for payload in payloads[21:]:
        rotate_and_save(ckpt, payload, keep=30)            # saves 1..10 fall off the end
    gone = {"sha256": hashlib.sha256(payloads[5]).hexdigest(), "next_token": 5, "step": 5,
            "bytes": len(payloads[5])}
    assert index.add(0, gone, stage=1, path="checkpoints/fractus_1b_gpu0.pt")["retained"] is None
    assert not list((pod / "checkpoints").rglob("*.pin"))


def test_a_large_checkpoint_read_late_is_not_retained_from_a_newer_save_of_the_same_size(
        tmp_path, monkeypatch):
    """Large files are checked by size only (hashing 8.8 GB every save is too slow) and every
    save of a run has the same size: an event read after the next save must not pin the
    newer bytes now under the worker's name as its own. The worker's real save reports the
    file's mtime; the event's own bytes, now name.1, are retained."""
    import time

    import torch

    import launcher.pod.ckpt_index as ckpt_index
    from fractus.train.checkpoint import save_checkpoint
    monkeypatch.setattr(ckpt_index, "VERIFY_BELOW_BYTES", 16)      # "large" from 16 bytes
    pod = tmp_path / "pod"
    ckpt = pod / "checkpoints" / "fractus_1b_gpu0.pt"
    payload = {"model_state": {"w": torch.zeros(256)}, "next_token": 0}
    old = save_checkpoint(payload, ckpt, keep=3)
    old_bytes = ckpt.read_bytes()
    time.sleep(0.05)
    new = save_checkpoint({**payload, "model_state": {"w": torch.ones(256)}}, ckpt, keep=3)
    assert new.bytes == old.bytes and new.sha256 != old.sha256      # the same size
    event = {"sha256": old.sha256, "next_token": 0, "step": 0, "bytes": old.bytes,
             "mtime_ns": old.mtime_ns}
    record = CheckpointIndex(pod).add(0, event, stage=1, path="checkpoints/fractus_1b_gpu0.pt")
    assert (pod / record["retained"]).read_bytes() == old_bytes


def test_an_event_read_late_costs_one_hash_not_one_per_newer_save(tmp_path, monkeypatch):
    """The Ray test's two-node pod (SAVE_KEEP 1000, a save every 5 steps of a tiny model):
    a poll that fell behind hashed every newer save's file to find an event's bytes, each
    late event cost more than the last, the node's poll never caught up, the launcher
    killed its worker as hung and waited on that poll for ever (CI, stop 23). The size and
    mtime the worker reported pick the one candidate; only it is hashed."""
    import torch

    import launcher.pod.ckpt_index as ckpt_index
    from fractus.train.checkpoint import save_checkpoint
    pod = tmp_path / "pod"
    ckpt = pod / "checkpoints" / "fractus_1b_gpu0.pt"
    saved = [save_checkpoint({"model_state": {"w": torch.full((64,), float(n))}}, ckpt,
                             keep=100) for n in range(60)]
    hashed = []
    real_sha256 = ckpt_index.sha256_file
    monkeypatch.setattr(ckpt_index, "sha256_file",
                        lambda path: hashed.append(path) or real_sha256(path))
    index = CheckpointIndex(pod)
    for n in (0, 30, 59):                          # read 59, 29 and 0 saves late
        event = {"sha256": saved[n].sha256, "next_token": n, "step": n,
                 "bytes": saved[n].bytes, "mtime_ns": saved[n].mtime_ns}
        record = index.add(0, event, stage=1, path="checkpoints/fractus_1b_gpu0.pt")
        data = (pod / record["retained"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == saved[n].sha256
    assert len(hashed) == 3, len(hashed)


def test_an_index_that_found_logs_never_makes_it_anew(tmp_path):
    """logs/ moved under a running launcher before its first checkpoint record: the record's
    write fails (the launcher reports logs/ moved, a pod error in one line) and no new,
    nearly empty logs/ hides the moved one (CI once: test_launcher_faults' moved logs/)."""
    import pytest

    pod = tmp_path / "pod"
    (pod / "logs").mkdir(parents=True)
    index = CheckpointIndex(pod)
    (pod / "logs").rename(pod / "logs.moved")
    event = {"sha256": "0" * 64, "next_token": 0, "step": 0}
    with pytest.raises(FileNotFoundError):
        index.add(0, event, stage=1, path="checkpoints/fractus_1b_gpu0.pt")
    assert not (pod / "logs").exists()
    fresh = CheckpointIndex(tmp_path / "fresh")          # a directory without logs/ yet
    fresh.add(0, event, stage=1, path="checkpoints/fractus_1b_gpu0.pt")
    assert (tmp_path / "fresh" / "logs" / "checkpoints.jsonl").is_file()
