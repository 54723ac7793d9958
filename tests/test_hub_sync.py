"""Hub sync policy: what a push holds (unit level, real files and a real file:// store) and
the launcher's push at the end of a bounded run with a file:// store (real processes)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.files import sha256_file
from launcher.hub import IntegrityError, open_store
from launcher.pod.manifest import apply_checkpoint, read_manifest, write_manifest
from launcher.config.podconfig import load_pod_config
from launcher.hub.redact import scrub
from launcher.hub.snapshot import record_revision, send, take_snapshot
from launcher.paths import MERGED_PATH
from tests.support.e2e import (TEST_CRITERIA, TOKENS_PER_STEP, Launcher,  # noqa: F401
                               events_of, launchers, make_pod, manifest_json,
                               worker_records)
from tests.support.hub_pod import (CKPT, FAST_PASS, MANIFEST, pod,  # noqa: F401 (fixture)
                                   write_checkpoint)


# ---- unit level: the snapshot -----------------------------------------------------------


def test_snapshot_holds_only_each_gpus_newest_passed_checkpoint(pod, tmp_path):
    config = load_pod_config(pod)
    manifest = read_manifest(pod / config.manifest)
    index = CheckpointIndex(pod)
    g0_passed = write_checkpoint(pod, index, manifest, 0, 100, PASSED)
    manifest.note_hub_revision(0, "rev-holding-token-100", g0_passed["sha256"])
    write_checkpoint(pod, index, manifest, 0, 200, "pending")          # newer, not yet judged
    g1_passed = write_checkpoint(pod, index, manifest, 1, 100, PASSED)
    write_checkpoint(pod, index, manifest, 1, 300, FAILED)             # newer, failed
    write_checkpoint(pod, index, manifest, 2, 100, "pending")          # never passed: not sent
    write_manifest(manifest)

    snap = take_snapshot(pod, config, manifest, index)
    assert snap.pushed == {0: (CKPT.format(0), g0_passed["sha256"]),
                           1: (CKPT.format(1), g1_passed["sha256"])}
    doc = snap.manifest_doc
    assert set(k for k in doc if k.startswith("gpu_")) == {"gpu_0", "gpu_1"}
    assert doc["gpu_0"]["start_token"] == 100 and doc["gpu_1"]["start_token"] == 100
    assert doc["gpu_0"]["checkpoint_sha256"] == g0_passed["sha256"]
    assert "hub_revision" not in doc["gpu_0"]       # a pushed manifest cannot know its own

    store = open_store("file://hub", pod)
    rev = send(store, snap, "unit")
    held = store.files(rev)
    assert held[CKPT.format(0)].sha256 == g0_passed["sha256"]
    assert held[CKPT.format(1)].sha256 == g1_passed["sha256"]
    assert {MANIFEST, "fractus-pod.yaml", "manifests/stages.yaml",
            "manifests/trusted_loss.yaml"} <= set(held)
    fresh = tmp_path / "fresh"
    open_store(f"file://{pod / 'hub'}", fresh).pull([MANIFEST], rev)
    assert json.loads((fresh / MANIFEST).read_text()) == doc
    # The local manifest names newer (pending/failed) bytes: no GPU gets this revision.
    assert record_revision(manifest, snap, rev) == []
    assert manifest.entries[0].hub_revision is None   # dropped when its bytes changed
    # Once the manifest names the pushed bytes again, the revision is recorded for it.
    manifest.entries[1].checkpoint_sha256 = g1_passed["sha256"]
    assert record_revision(manifest, snap, rev) == [1]
    assert manifest.entries[1].hub_revision == rev
    snap.discard()


def test_send_refuses_bytes_that_changed_after_the_snapshot(pod):
    config = load_pod_config(pod)
    manifest = read_manifest(pod / config.manifest)
    index = CheckpointIndex(pod)
    write_checkpoint(pod, index, manifest, 0, 100, PASSED)
    snap = take_snapshot(pod, config, manifest, index)
    linked = snap.files[CKPT.format(0)]
    linked.write_bytes(b"damaged")                  # the same inode as the retained file
    store = open_store("file://hub", pod)
    with pytest.raises(IntegrityError, match="changed on disk"):
        send(store, snap, "unit")
    assert store.head() is None


def test_a_push_carries_pinned_bytes_when_the_worker_saved_past_save_keep_before_its_event_was_read(
        pod):
    """CI: under load the launcher read a checkpoint event after the worker had saved again
    past SAVE_KEEP; that checkpoint has no retained link, the worker's file name holds newer
    bytes, and the push of that name was refused ("changed on disk"; nothing committed). The
    push carries the newest passed checkpoint whose bytes are pinned instead."""
    from fractus.train.checkpoint import save_checkpoint
    config = load_pod_config(pod)
    manifest = read_manifest(pod / config.manifest)
    index = CheckpointIndex(pod)
    path = pod / CKPT.format(0)

    def save(token: int) -> dict:
        saved = save_checkpoint({"model_state": {"w": torch.full((64,), float(token))},
                                 "next_token": token}, path, keep=3)
        return {"path": saved.path, "sha256": saved.sha256, "next_token": token,
                "step": token // 32, "ema_tf": 5.0, "lb": 1.0, "bytes": saved.bytes}

    def judge(event: dict) -> dict:
        record = index.add(0, event, 1, CKPT.format(0))
        index.mark(0, event["sha256"], PASSED, "test")
        apply_checkpoint(manifest, 0, event, 1, pod, "data/shard_phase2_gpu0.npy")
        return record

    pinned = judge(save(100))                       # read in time: linked under retained/
    assert pinned["retained"]
    late = [save(token) for token in (200, 300, 400, 500)]   # keep=3: 200's bytes are gone
    assert judge(late[0])["retained"] is None
    assert sha256_file(path) == late[-1]["sha256"]  # the name holds the newest save

    snap = take_snapshot(pod, config, manifest, index)
    store = open_store("file://hub", pod)
    rev = send(store, snap, "unit")
    assert store.files(rev)[CKPT.format(0)].sha256 == pinned["sha256"]
    assert snap.manifest_doc["gpu_0"]["checkpoint_sha256"] == pinned["sha256"]
    assert snap.manifest_doc["gpu_0"]["start_token"] == 100
    snap.discard()


@pytest.mark.parametrize("sync, problem", [
    ({"interval": "1h", "merge": True}, None),
    ({"interval_s": 600}, None),                     # the name issue 4's presets wrote
    ({"intervall": 60}, "unknown key"),
    ({"interval": "soon"}, "duration"),
    ({"interval": 0}, "duration"),
    ({"merge": "yes"}, "true or false"),
    ({"attempts": 0}, "attempts"),
])
def test_sync_policy_is_checked_when_the_config_is_read(pod, sync, problem):
    import yaml

    from launcher.errors import UserError
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump({**config, "sync": sync}))
    if problem is None:
        settings = load_pod_config(pod).sync_settings()
        assert settings.interval_s == (3600 if "interval" in sync else 600)
        assert settings.merge is sync.get("merge", False)
    else:
        with pytest.raises(UserError, match=problem):
            load_pod_config(pod)


def test_scrub_removes_the_token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_" + "k9" * 10)
    text = scrub(f"401 for Bearer {os.environ['HF_TOKEN']} and hf_otherSecretValue123")
    assert "hf_secret_" not in text and "otherSecretValue" not in text


# ---- real launcher, file:// store -------------------------------------------------------
def test_bounded_run_pushes_at_stop_and_launch_restores_missing_checkpoints(tmp_path,
                                                                           launchers):
    pod = make_pod(tmp_path, criteria=FAST_PASS, hub="file://hub",
                   sync={"interval": 3600, "merge": True})
    launcher = Launcher(pod, "--stage", "1", "--max-steps", "8")
    launchers.append(launcher)
    assert launcher.wait(120) == 0, launcher.output()

    (pushed,) = events_of(pod, "sync_pushed")         # interval not due: only the stop push
    assert pushed["reason"] == "stop"
    store = open_store("file://hub", pod)
    history = store.history()
    assert [h.revision for h in history] == [pushed["revision"]]
    held = store.files(pushed["revision"])
    manifest = manifest_json(pod)
    for gpu in (0, 1):
        entry = manifest[f"gpu_{gpu}"]
        assert entry["start_token"] == 8 * TOKENS_PER_STEP
        assert held[CKPT.format(gpu)].sha256 == entry["checkpoint_sha256"]
        assert entry["hub_revision"] == pushed["revision"]
    assert json.loads((pod / "logs" / "sync_state.json").read_text())["last_revision"] \
        == pushed["revision"]
    # sync.merge: the mean of the pushed checkpoints went up in the same commit.
    fresh = tmp_path / "fresh"
    open_store(f"file://{pod / 'hub'}", fresh).pull([MERGED_PATH, CKPT.format(0),
                                                     CKPT.format(1)], pushed["revision"])
    merged = torch.load(fresh / MERGED_PATH, weights_only=True)["model_state"]
    gpus = [torch.load(fresh / CKPT.format(g), weights_only=True)["model_state"] for g in (0, 1)]
    floats = [k for k, v in merged.items() if v.is_floating_point()]
    assert floats and not torch.equal(gpus[0][floats[0]], gpus[1][floats[0]])
    for key in floats:
        torch.testing.assert_close(merged[key], (gpus[0][key] + gpus[1][key]) / 2)

    # A lost and a damaged checkpoint: launch restores both first. The lost one from its
    # retained hard link (a local copy whose sha256 matches); the one damaged in place
    # (every hard link sees it) from the pinned revision.
    expected = {g: manifest[f"gpu_{g}"]["checkpoint_sha256"] for g in (0, 1)}
    (pod / CKPT.format(1)).unlink()
    (pod / CKPT.format(0)).write_bytes(b"not a checkpoint")
    again = Launcher(pod, "--max-steps", "1")
    launchers.append(again)
    assert again.wait(120) == 0, again.output()
    (recovered,) = events_of(pod, "checkpoint_recovered")
    assert recovered["gpu"] == 1 and recovered["was"] == CKPT.format(1)
    (pulled,) = events_of(pod, "checkpoint_pulled")
    assert pulled["gpu"] == 0 and pulled["revision"] == pushed["revision"]
    for gpu in (0, 1):
        start = worker_records(pod, gpu, "start")[-1]
        assert start["next_token"] == 8 * TOKENS_PER_STEP
        record = [r for r in CheckpointIndex(pod).for_gpu(gpu)
                  if r["sha256"] == expected[gpu]]
        assert record and record[0]["verdict"] == PASSED


def test_a_clean_end_judges_the_final_checkpoints_so_the_hub_holds_where_the_run_ended(
        tmp_path, launchers):
    # Periodic checks (every 5 steps) and an AR probe of every 100th checkpoint: during the
    # run neither has vouched for the last checkpoint (step 8) when the run ends.
    criteria = {**TEST_CRITERIA, "probe": {"every": 100, "band": 1e9}}
    pod = make_pod(tmp_path, criteria=criteria, hub="file://hub", sync={"interval": 3600})
    launcher = Launcher(pod, "--stage", "1", "--max-steps", "8")
    launchers.append(launcher)
    assert launcher.wait(120) == 0, launcher.output()

    (final,) = events_of(pod, "final_verdicts")
    for gpu in (0, 1):
        verdict = final["verdicts"][str(gpu)]
        assert verdict["step"] == 8 and verdict["verdict"] == PASSED, verdict
        (probe,) = events_of(pod, "probe", gpu=gpu)          # the final probe, nothing else
        assert probe["step"] == 8 and probe["status"] != "Failed"
    (pushed,) = events_of(pod, "sync_pushed")
    assert pushed["ts"] > final["ts"]
    assert pushed["tokens"] == {"0": 8 * TOKENS_PER_STEP, "1": 8 * TOKENS_PER_STEP}
    manifest = manifest_json(pod)
    for gpu in (0, 1):
        assert manifest[f"gpu_{gpu}"]["start_token"] == 8 * TOKENS_PER_STEP
        assert manifest[f"gpu_{gpu}"]["hub_revision"] == pushed["revision"]
