"""Checkpoint io: atomic write, sha256 of the file, rotation, non-finite refusal, RNG round trip."""

import json
import random

import pytest
import torch

from fractus.train.checkpoint import (NonFiniteCheckpointError, capture_rng, is_full,
                                      load_checkpoint, remove_stale_temps, restore_rng,
                                      rotated_path, save_checkpoint)
from launcher.files import sha256_file
from fractus.train.metrics import MetricsWriter, human_line


def payload(value: float, step: int = 0) -> dict:
    return {"model_state": {"w": torch.full((4, 4), value)}, "config": {"vocab_size": 8},
            "optimizer_state": {"state": {}, "param_groups": []},
            "train_state": {"step": step, "rng": capture_rng(torch.device("cpu"))}}


def test_save_reports_the_sha256_and_size_of_the_file(tmp_path):
    path = tmp_path / "ck" / "fractus_1b_gpu0.pt"
    saved = save_checkpoint(payload(1.0), path, keep=3)
    assert saved.path == str(path)
    assert saved.sha256 == sha256_file(path) and saved.bytes == path.stat().st_size
    ck = load_checkpoint(path)  # weights_only=True
    assert is_full(ck) and torch.equal(ck["model_state"]["w"], torch.ones(4, 4))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_keeps_the_last_k(tmp_path):
    path = tmp_path / "fractus_1b_gpu3.pt"
    for step in range(1, 6):
        save_checkpoint(payload(float(step), step), path, keep=3)
    assert load_checkpoint(path)["train_state"]["step"] == 5
    assert load_checkpoint(rotated_path(path, 1))["train_state"]["step"] == 4
    assert load_checkpoint(rotated_path(path, 2))["train_state"]["step"] == 3
    assert not rotated_path(path, 3).exists()
    save_checkpoint(payload(6.0, 6), path, keep=1)  # SAVE_KEEP shrank: older copies pruned
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_non_finite_weights_never_replace_the_last_good_file(tmp_path):
    path = tmp_path / "fractus_1b_gpu0.pt"
    good = save_checkpoint(payload(1.0), path)
    with pytest.raises(NonFiniteCheckpointError):
        save_checkpoint(payload(float("nan")), path)
    assert sha256_file(path) == good.sha256
    assert not rotated_path(path, 1).exists()


def test_stale_temp_files_are_removed(tmp_path):
    path = tmp_path / "fractus_1b_gpu0.pt"
    stale = tmp_path / ".fractus_1b_gpu0.pt.tmp.999"
    stale.write_bytes(b"partial")
    other = tmp_path / ".fractus_1b_gpu1.pt.tmp.999"
    other.write_bytes(b"someone else's")
    remove_stale_temps(path)
    assert not stale.exists() and other.exists()


def test_legacy_file_is_not_full(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"model_state": {"w": torch.ones(1)}, "config": {}}, path)
    assert not is_full(load_checkpoint(path))
    torch.save({"weights": 1}, tmp_path / "foreign.pt")
    with pytest.raises(ValueError, match="not a Fractus checkpoint"):
        load_checkpoint(tmp_path / "foreign.pt")


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    random.seed(5)
    torch.manual_seed(5)
    save_checkpoint(payload(1.0), tmp_path / "c.pt")
    expected = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    restore_rng(load_checkpoint(tmp_path / "c.pt")["train_state"]["rng"], torch.device("cpu"))
    got = (random.random(), torch.rand(3))
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])


def test_metrics_writer_lines(tmp_path):
    log = MetricsWriter(tmp_path / "m" / "metrics.jsonl", gpu=2)
    log.event("start", pid=1, next_token=7, settings={"a": 1})
    log.metrics(step=1, next_token=39, tf=3.0, ema_tf=3.0, ss=None, ema_ss=None, lb=float("nan"),
                grad_norm=1.5, tok_s=10.0, mem_gb=0.1)
    with pytest.raises(ValueError, match="lacks"):
        log.metrics(step=1)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["type"] == "event" and lines[0]["event"] == "start" and lines[0]["gpu"] == 2
    assert lines[1]["type"] == "metrics" and lines[1]["lb"] is None and lines[1]["ss"] is None
    assert "ts" in lines[1] and lines[1]["next_token"] == 39


def test_human_line_is_the_v1_format():
    line = human_line(3, 1234567, 2.5, 2.75, None, None, 14.0, 950.4, 1.23)
    assert line == ("GPU 3:    1,234,567 tf=2.500 ema_tf=2.750 lb=14.000 950 tok/s mem=1.2GB "
                    "[boost]")
    with_ss = human_line(0, 10, 1.0, 1.0, 2.0, 2.5, 0.1, 1.0, 0.0)
    assert " ss=2.000 ema_ss=2.500 lb=" in with_ss
