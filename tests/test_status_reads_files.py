"""`status` reads files (issue 25, items 9, 10 and 26): it never imports torch (a shard's
length comes from its header, the same the worker's reader finds), an age is never negative
however slow the collection, and what stands in a shard's place is named as what it is."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fractus.data import ShardError, TokenShard
from launcher.config.podconfig import load_pod_config
from launcher.dashboard import status as status_module
from launcher.dashboard.status import collect
from launcher.pod.manifest import ManifestError, read_manifest
from launcher.pod.shards import header_length, shard_length
from tests.support.dashboard import copy_recorded_pod, status_in_process

SHARD_TOKENS = 50_000


def recorded_pod_with_shards(dest: Path) -> Path:
    pod = copy_recorded_pod(dest)
    config = load_pod_config(pod)
    for gpu in (0, 1):
        path = pod / config.shard_path(gpu, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.arange(SHARD_TOKENS, dtype=np.int32))
    return pod


def test_issue25_status_never_imports_torch_and_still_shows_the_shard_share(tmp_path):
    pod = recorded_pod_with_shards(tmp_path / "pod")
    code, report, loaded = status_in_process(pod, ("torch",))
    assert (code, loaded) == (0, [])
    rows = report["gpus"]
    assert [r["shard_tokens"] for r in rows] == [SHARD_TOKENS, SHARD_TOKENS]
    assert rows[0]["shard_pct"] == pytest.approx(100.0 * rows[0]["next_token"] / SHARD_TOKENS)


@pytest.mark.parametrize("suffix, make, expected", [
    (".npy", lambda p: np.save(p, np.arange(100, dtype=np.int32)), 100),
    (".npy", lambda p: np.save(p, np.arange(70, dtype=np.uint16)), 70),
    (".npy", lambda p: np.save(p, np.arange(5, dtype=">i4")), 5),               # big-endian
    (".npy", lambda p: _npy_v2(p, np.arange(6, dtype=np.int64)), 6),            # format 2.0
    (".npy", lambda p: np.save(p, np.zeros(4, dtype=bool)), None),
    (".pt", lambda p: torch.save(torch.arange(9), p), 9),
    (".pt", lambda p: torch.save(torch.arange(30, dtype=torch.int32)[5:12], p), 7),
    (".npy", lambda p: np.save(p, np.zeros((3, 4), dtype=np.int32)), None),      # 2-D
    (".npy", lambda p: np.save(p, np.zeros(5, dtype=np.float32)), None),          # floats
    (".pt", lambda p: torch.save(torch.zeros(5), p), None),
    (".pt", lambda p: torch.save({"tokens": torch.arange(5)}, p), None),
    (".npy", lambda p: p.write_bytes(b""), None),                                 # empty
    (".pt", lambda p: p.write_bytes(b"PK garbage"), None),
])
def test_issue25_a_shards_header_length_is_the_workers_length(tmp_path, suffix, make,
                                                              expected):
    path = tmp_path / f"shard{suffix}"
    make(path)
    assert header_length(path) == expected
    try:
        workers = len(TokenShard(path))
    except ShardError:
        workers = None
    assert workers == expected
    if expected is not None:
        assert shard_length(path) == expected
    else:                       # shard_length asks the worker's reader, which refuses it
        with pytest.raises(ManifestError):
            shard_length(path)


def _npy_v2(path: Path, array) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, array, version=(2, 0))


def test_issue25_a_cut_npy_is_no_shard_without_its_data(tmp_path):
    path = tmp_path / "shard.npy"
    np.save(path, np.arange(100, dtype=np.int32))
    path.write_bytes(path.read_bytes()[:-4])
    assert header_length(path) is None
    with pytest.raises(ManifestError):
        shard_length(path)


def test_issue25_a_fifo_for_a_shard_is_named_a_fifo_never_not_found(tmp_path):
    fifo = tmp_path / "shard.npy"
    os.mkfifo(fifo)
    assert header_length(fifo) is None          # never opened: a reader would block
    with pytest.raises(ShardError) as worker:
        TokenShard(fifo)
    with pytest.raises(ManifestError) as launcher:
        shard_length(fifo)
    for message in (str(worker.value), str(launcher.value)):
        assert "FIFO" in message and "not found" not in message, message


def test_issue25_an_age_is_never_negative_when_a_file_changes_during_the_collection(
        tmp_path, monkeypatch):
    pod = recorded_pod_with_shards(tmp_path / "pod")
    config = load_pod_config(pod)
    checkpoint = pod / read_manifest(pod / config.manifest).entries[0].checkpoint
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.touch()
    read_metrics = status_module.last_metrics

    def slow_read(path):        # the GPU saves while status reads its metrics
        time.sleep(0.05)
        stamp = time.time()
        os.utime(checkpoint, (stamp, stamp))
        return read_metrics(path)
    monkeypatch.setattr(status_module, "last_metrics", slow_read)
    report = collect(pod, config)
    assert report["gpus"][0]["checkpoint_age_s"] >= 0
