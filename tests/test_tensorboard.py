"""TensorBoard event files, read back with tensorboard's own reader (EventAccumulator):
the worker's scalars (TB_DIR) equal its METRICS lines, and the launcher's decisions are text
entries of logs/tb/launcher."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from launcher.pod.events import EventLog
from launcher.pod.events_tensorboard import EventsToTensorBoard
from launcher.paths import TENSORBOARD_RUN
from tests.support.worker_utils import read_jsonl, run_worker, worker_env, write_synth_shard


def _load(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_worker_writes_its_metrics_as_tensorboard_scalars(tmp_path):
    write_synth_shard(tmp_path / "shard.npy", tokens=4000)
    env = worker_env(tmp_path, MAX_STEPS=5, SS_RATE=1, TB_DIR=tmp_path / "tb" / "gpu0", STAGE=3)
    proc = run_worker(env)
    assert proc.returncode == 0, proc.stderr
    lines = [r for r in read_jsonl(env["METRICS"]) if r.get("type") == "metrics"]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]

    acc = _load(tmp_path / "tb" / "gpu0")
    tags = set(acc.Tags()["scalars"])
    assert tags == {"loss/tf", "loss/ema_tf", "loss/ss", "loss/ema_ss", "lb", "grad_norm",
                    "tok_s", "mem_gb", "stage"}
    for field, tag in (("ema_tf", "loss/ema_tf"), ("lb", "lb"), ("tok_s", "tok_s"),
                       ("grad_norm", "grad_norm")):
        points = acc.Scalars(tag)
        assert [p.step for p in points] == [r["step"] for r in lines], tag
        # TensorBoard stores float32: equal to the JSON value at that precision.
        assert [p.value for p in points] == pytest.approx([r[field] for r in lines],
                                                          rel=1e-6), tag
        assert [p.wall_time for p in points] == pytest.approx([r["ts"] for r in lines])
    assert {p.value for p in acc.Scalars("stage")} == {3.0}


def test_worker_without_tb_dir_writes_no_event_file(tmp_path):
    write_synth_shard(tmp_path / "shard.npy", tokens=4000)
    proc = run_worker(worker_env(tmp_path, MAX_STEPS=2))
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.rglob("events.out.tfevents.*"))


def test_launcher_events_are_tensorboard_text_entries(tmp_path):
    mirror = EventsToTensorBoard(tmp_path)
    log = EventLog(tmp_path, mirror=mirror)
    log.emit("launch", stage=3, gpus=[0, 1])
    rollback = log.emit("rollback", gpu=1, from_stage=3, to_stage=2, to_token=800)
    mirror.close()

    acc = _load(tmp_path / TENSORBOARD_RUN)
    assert set(acc.Tags()["tensors"]) == {"events/launch/text_summary",
                                         "events/rollback/text_summary"}
    (entry,) = acc.Tensors("events/rollback/text_summary")
    text = entry.tensor_proto.string_val[0].decode()
    assert text.startswith("**rollback**")
    assert json.loads(text.split("`")[1]) == {"gpu": 1, "from_stage": 3, "to_stage": 2,
                                             "to_token": 800}
    assert entry.step == int(rollback["ts"])
    assert entry.wall_time == pytest.approx(rollback["ts"])
