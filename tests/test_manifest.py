"""The resume manifest: both layouts in, each written back in its own layout, never backwards."""

import json
import os

import pytest

from launcher.pod.manifest import (BackwardsError, ManifestError, apply_checkpoint, apply_rollback,
                               read_manifest, write_manifest)


def write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_current_layout_round_trip_keeps_unknown_fields(tmp_path):
    path = write(tmp_path / "m.json", {
        "note": "user field", "gpu_0": {"start_token": 100, "tokens_processed": 7},
        "gpu_3": {"start_token": 5, "checkpoint": "c3.pt", "custom": [1, 2]}})
    m = read_manifest(path)
    assert m.layout == "current" and sorted(m.entries) == [0, 3]
    write_manifest(m)
    data = json.load(open(path))
    assert data["note"] == "user field"
    # tokens_processed means start_token: kept true (it said 7: stale, now 100)
    assert data["gpu_0"] == {"start_token": 100, "tokens_processed": 100}
    assert data["gpu_3"]["custom"] == [1, 2]
    assert json.load(open(path))["gpu_3"]["start_token"] == 5      # the user's one-liner


def test_older_layout_is_written_back_in_its_own_layout(tmp_path):
    user = {"saved_at_utc": "2026-08-16", "step_tokens": 256, "surgery": {"gate_temp": 2.5},
            "gpus": {
                "0": {"tokens_processed": 4096, "start_token": 4096, "last_loss": 5.1,
                      "checkpoint": "checkpoints/fractus_1b_gpu0.pt", "shard": "data/s0.npy"},
                "1": {"start_token": 2048}},
            "created": "2026-08-01"}
    path = write(tmp_path / "m.json", user)
    m = read_manifest(path)
    assert m.layout == "older" and m.start_token(0) == 4096 and m.start_token(1) == 2048
    apply_checkpoint(m, 0, {"next_token": 8192, "path": "checkpoints/fractus_1b_gpu0.pt",
                            "sha256": "ab" * 32}, 1, tmp_path, "data/s0.npy")
    write_manifest(m)
    data = json.load(open(path))
    assert list(data) == list(user)                       # same keys, same places
    assert {k: data[k] for k in ("saved_at_utc", "step_tokens", "surgery", "created")} == \
        {k: user[k] for k in ("saved_at_utc", "step_tokens", "surgery", "created")}
    assert not any(k.startswith("gpu_") for k in data)
    gpu0 = data["gpus"]["0"]
    assert gpu0["start_token"] == 8192 and gpu0["tokens_processed"] == 8192   # the user's reader
    assert gpu0["last_loss"] == 5.1 and list(gpu0)[:5] == list(user["gpus"]["0"])
    assert data["gpus"]["1"] == {"start_token": 2048}
    write_manifest(read_manifest(path))                   # read back: still the same layout
    assert json.load(open(path)) == data


def test_missing_manifest_is_an_empty_fresh_pod(tmp_path):
    m = read_manifest(tmp_path / "absent.json")
    assert not m.exists and m.entries == {} and m.start_token(2) == 0


@pytest.mark.parametrize("text, words", [
    ('{"gpu_0": {"start_token": -1}}', "negative"),
    ('{"gpu_0": {"start_token": 1.0}}', "must be an integer"),
    ('{"gpu_0": {"start_token": true}}', "must be an integer"),
    ('{"gpu_0": {}}', "no start_token"),
    ('{"gpu_0": 5}', "must be an object"),
    ('{"gpu_2": {"start_token": 0}, "gpu_2": {"start_token": 9}}', "appears twice"),
    ('{"gpu_2": {"start_token": 0}, "gpu_002": {"start_token": 0}}', "GPU 2 is listed twice"),
    ('{"gpus": {"x": {"start_token": 0}}}', "not a GPU index"),
    ('[1, 2]', "JSON object"),
    ('{"gpu_0": ', "invalid JSON"),
])
def test_malformed_manifest_raises_one_line(tmp_path, text, words):
    with pytest.raises(ManifestError) as info:
        read_manifest(write(tmp_path / "m.json", text))
    assert words in str(info.value) and "\n" not in str(info.value)
    assert info.value.exit_code == 2


def _event(next_token, sha="a" * 64, path="checkpoints/fractus_1b_gpu0.pt"):
    return {"next_token": next_token, "sha256": sha, "path": path, "ema_tf": 4.5, "lb": 14.0,
            "step": next_token // 64}


def test_checkpoint_events_advance_and_never_go_backwards(tmp_path):
    m = read_manifest(tmp_path / "m.json")
    assert apply_checkpoint(m, 0, _event(640), 3, tmp_path, "data/s0.npy")
    entry = m.entries[0]
    assert entry["start_token"] == 640 and entry["stage"] == 3 and entry["lb"] == 14.0
    assert entry["checkpoint_sha256"] == "a" * 64 and entry["shard"] == "data/s0.npy"
    assert not apply_checkpoint(m, 0, _event(640), 3, tmp_path, "data/s0.npy")  # a repeat
    with pytest.raises(BackwardsError):
        apply_checkpoint(m, 0, _event(320, sha="b" * 64), 3, tmp_path, "data/s0.npy")
    assert m.entries[0]["start_token"] == 640


def test_absolute_checkpoint_path_is_stored_relative_to_the_pod(tmp_path):
    m = read_manifest(tmp_path / "m.json")
    apply_checkpoint(m, 1, _event(64, path=str(tmp_path / "checkpoints" / "x.pt")), 1,
                     tmp_path, "data/s1.npy")
    assert m.entries[1]["checkpoint"] == os.path.join("checkpoints", "x.pt")


def test_rollback_is_the_only_way_back(tmp_path):
    m = read_manifest(tmp_path / "m.json")
    apply_checkpoint(m, 0, _event(1280), 3, tmp_path, "data/s0.npy")
    before = apply_rollback(m, 0, {"next_token": 640, "path": "checkpoints/retained/a.pt",
                                   "sha256": "c" * 64, "ema_tf": 4.9, "lb": 13.0}, stage=2)
    assert before["start_token"] == 1280
    assert m.entries[0]["start_token"] == 640 and m.entries[0]["stage"] == 2
    assert m.entries[0]["checkpoint"] == "checkpoints/retained/a.pt"


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = write(tmp_path / "m.json", {"gpu_0": {"start_token": 1}})
    m = read_manifest(path)
    m.entries[0]["start_token"] = 2
    write_manifest(m)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]
    assert json.load(open(path))["gpu_0"]["start_token"] == 2
