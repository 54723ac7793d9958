"""The typed manifest entry: each layout read and written back with the user's fields as they
were, types checked once when read, and the named operations that change an entry."""

import json

import pytest

from launcher.pod.manifest import (ManifestEntry, ManifestError, apply_checkpoint, current_stage,
                                   read_manifest, write_manifest)

SHA_A, SHA_B = "a" * 64, "b" * 64


def write(path, data):
    path.write_text(json.dumps(data))
    return path


def test_current_layout_round_trip_is_typed_and_keeps_foreign_fields_verbatim(tmp_path):
    user = {"run_id": "r1", "note": {"by": "me"},
            "gpu_2": {"custom": [1, {"x": None}], "start_token": 640, "stage": 2,
                      "checkpoint": "checkpoints/c2.pt", "ema_tf": None, "last_loss": 5.25,
                      "tokens_processed": 640}}
    path = write(tmp_path / "m.json", user)
    entry = read_manifest(path).entries[2]
    assert isinstance(entry, ManifestEntry)
    assert (entry.start_token, entry.stage, entry.checkpoint) == (640, 2, "checkpoints/c2.pt")
    assert entry.ema_tf is None and entry.lb is None and entry.hub_revision is None
    assert entry.foreign == {"custom": [1, {"x": None}], "last_loss": 5.25,
                             "tokens_processed": 640}
    write_manifest(read_manifest(path))
    data = json.loads(path.read_text())
    # ours first (the launcher's order), then the user's, which are untouched; a field the
    # user wrote as null stays null, one they never wrote does not appear
    assert list(data["gpu_2"]) == ["start_token", "checkpoint", "stage", "ema_tf", "custom",
                                   "last_loss", "tokens_processed"]
    assert data["gpu_2"]["ema_tf"] is None and "lb" not in data["gpu_2"]
    assert data == user | {"gpu_2": {k: user["gpu_2"][k] for k in data["gpu_2"]}}


def test_older_layout_round_trip_keeps_the_users_order_and_adds_ours_after(tmp_path):
    user = {"step_tokens": 256,
            "gpus": {"0": {"tokens_processed": 100, "last_loss": 5.1, "start_token": 100,
                           "shard": "data/s0.npy", "hub_revision": "rev-0"}},
            "created": "2026-08-01"}
    path = write(tmp_path / "m.json", user)
    m = read_manifest(path)
    write_manifest(m)
    assert json.loads(path.read_text()) == user            # nothing changed: same bytes back
    apply_checkpoint(m, 0, {"next_token": 200, "path": "checkpoints/g0.pt", "sha256": SHA_A,
                            "ema_tf": 4.5}, 1, tmp_path, "data/s0.npy")
    write_manifest(m)
    gpu0 = json.loads(path.read_text())["gpus"]["0"]
    # the user's keys where they were (hub_revision gone: it named other bytes), ours after
    assert list(gpu0) == ["tokens_processed", "last_loss", "start_token", "shard",
                          "checkpoint", "checkpoint_sha256", "stage", "ema_tf", "lb",
                          "updated_at"]
    assert gpu0["tokens_processed"] == gpu0["start_token"] == 200
    assert gpu0["last_loss"] == 5.1 and gpu0["lb"] is None     # the event had no lb


@pytest.mark.parametrize("field, value, words", [
    ("checkpoint", 7, "checkpoint must be a path string"),
    ("checkpoint", "", "checkpoint must be a path string"),
    ("checkpoint_sha256", "ABC", "checkpoint_sha256 must be a 64-digit hex sha256"),
    ("shard", ["data/s.npy"], "shard must be a path string"),
    ("stage", 0, "stage must be an integer >= 1"),
    ("stage", "2", "stage must be an integer >= 1"),
    ("stage", True, "stage must be an integer >= 1"),
    ("ema_tf", "4.2", "ema_tf must be a number"),
    ("lb", False, "lb must be a number"),
    ("updated_at", "yesterday", "updated_at must be a number (unix time)"),
    ("hub_revision", 12, "hub_revision must be a revision string"),
])
def test_a_field_of_the_wrong_type_is_refused_when_read_in_either_layout(tmp_path, field,
                                                                       value, words):
    for layout in ({"gpu_1": {"start_token": 0, field: value}},
                   {"gpus": {"1": {"start_token": 0, field: value}}}):
        with pytest.raises(ManifestError) as info:
            read_manifest(write(tmp_path / "m.json", layout))
        message = str(info.value)
        assert f"gpu_1 {words}, got {value!r}; fix or remove that field" in message
        assert str(tmp_path / "m.json") in message and "\n" not in message
        assert info.value.exit_code == 2


def test_a_foreign_field_of_any_type_is_kept_unchecked(tmp_path):
    path = write(tmp_path / "m.json", {"gpu_0": {"start_token": 3, "stage_name": 5,
                                                 "checkpoints": None}})
    assert read_manifest(path).entries[0].foreign == {"stage_name": 5, "checkpoints": None}


def test_the_stage_is_derived_from_the_entries_in_one_place(tmp_path):
    path = write(tmp_path / "m.json", {"gpu_0": {"start_token": 0, "stage": 3},
                                       "gpu_1": {"start_token": 0, "stage": 2},
                                       "gpu_2": {"start_token": 0}})
    m = read_manifest(path)
    assert m.recorded_stages() == [2, 3] and m.recorded_stage() == 2
    assert m.recorded_stage({0, 2}) == 3 and m.recorded_stage({2}) is None
    # the running launcher's stage wins; without one, the manifest's
    assert current_stage({"stage": 4}, m) == 4 and current_stage(None, m) == 2
    assert current_stage({}, m) == 2 and current_stage(None, None) is None
    m.set_stage(1, {1, 2})
    assert [m.entries[g].stage for g in (0, 1, 2)] == [3, 1, 1]


def test_hub_revision_is_noted_only_for_the_bytes_the_entry_names(tmp_path):
    m = read_manifest(write(tmp_path / "m.json", {"gpu_0": {
        "start_token": 64, "checkpoint": "checkpoints/g0.pt", "checkpoint_sha256": SHA_A}}))
    assert not m.note_hub_revision(0, "rev-b", SHA_B)                 # other bytes
    assert not m.note_hub_revision(0, "rev-a", SHA_A, checkpoint="checkpoints/other.pt")
    assert not m.note_hub_revision(5, "rev-a", SHA_A)                 # no such GPU
    assert m.entries[0].hub_revision is None
    assert m.note_hub_revision(0, "rev-a", SHA_A, checkpoint="checkpoints/g0.pt")
    assert m.entries[0].hub_revision == "rev-a"
    # advancing to other bytes forgets it; rolling back to the same bytes keeps it
    m.entries[0].roll_back({"next_token": 64, "path": "checkpoints/retained/g0.pt",
                            "sha256": SHA_A}, stage=1)
    assert m.entries[0].hub_revision == "rev-a"
    apply_checkpoint(m, 0, {"next_token": 128, "path": "checkpoints/g0.pt", "sha256": SHA_B},
                     1, tmp_path, "data/s0.npy")
    assert m.entries[0].hub_revision is None and "hub_revision" not in m.entries[0]


def test_start_over_drops_what_describes_the_checkpoint_and_keeps_the_users_fields(tmp_path):
    path = write(tmp_path / "m.json", {"gpus": {"0": {
        "start_token": 64, "checkpoint": "checkpoints/g0.pt", "checkpoint_sha256": SHA_A,
        "ema_tf": 4.0, "lb": 14.0, "hub_revision": "rev", "shard": "data/s0.npy",
        "stage": 2, "last_loss": 5.0}}})
    m = read_manifest(path)
    m.entries[0].start_over()
    write_manifest(m)
    gpu0 = json.loads(path.read_text())["gpus"]["0"]
    assert gpu0.pop("updated_at") > 0
    assert gpu0 == {"start_token": 0, "shard": "data/s0.npy", "stage": 2, "last_loss": 5.0}


def test_reset_entry_puts_back_a_copy_or_removes_the_gpu(tmp_path):
    m = read_manifest(write(tmp_path / "m.json", {"gpu_0": {"start_token": 64,
                                                            "checkpoint": "c.pt", "x": [1]}}))
    at_launch = m.entries[0].copy()
    apply_checkpoint(m, 0, {"next_token": 128, "path": "d.pt", "sha256": SHA_A}, 1, tmp_path,
                     "data/s0.npy")
    m.reset_entry(0, at_launch)
    assert m.entries[0] == at_launch and m.entries[0] is not at_launch
    m.entries[0].foreign["x"].append(2)
    assert at_launch.foreign["x"] == [1]                  # a copy, not shared
    m.reset_entry(0, None)
    assert m.entries == {}


def test_the_pushed_entry_names_the_hub_path_and_no_revision(tmp_path):
    m = read_manifest(write(tmp_path / "m.json", {"gpu_0": {
        "start_token": 192, "checkpoint": "checkpoints/retained/x.pt", "stage": 2,
        "hub_revision": "old", "updated_at": 5.0, "mine": "kept"}}))
    pushed = m.entries[0].as_pushed({"next_token": 128, "sha256": SHA_A, "ema_tf": 4.0},
                                    "checkpoints/fractus_1b_gpu0.pt", "data/s0.npy")
    assert pushed.to_json("current") == {
        "start_token": 128, "checkpoint": "checkpoints/fractus_1b_gpu0.pt",
        "checkpoint_sha256": SHA_A, "shard": "data/s0.npy", "stage": 2, "ema_tf": 4.0,
        "lb": None, "updated_at": 5.0, "mine": "kept"}
    assert m.entries[0].hub_revision == "old" and m.entries[0].start_token == 192


def test_the_pushed_entry_keeps_the_stage_the_pod_resumes_at_not_the_checkpoints(tmp_path):
    """Issue 18. Seen: a stage-3 checkpoint rolled back to stage 2 went to the hub as stage
    3 (the checkpoint's), so `launch --from-hub` resumed at stage 3."""
    m = read_manifest(write(tmp_path / "m.json", {
        "gpu_0": {"start_token": 128, "stage": 2},
        "gpu_1": {"start_token": 128}}))
    trained_at_3 = {"next_token": 128, "sha256": SHA_A, "stage": 3}
    hub_path = "checkpoints/fractus_1b_gpu0.pt"
    assert m.entries[0].as_pushed(trained_at_3, hub_path, "data/s0.npy").stage == 2
    # An entry recording no stage yet: the checkpoint's is all there is.
    assert m.entries[1].as_pushed(trained_at_3, hub_path, "data/s1.npy").stage == 3


def test_a_checkpoint_written_after_the_launcher_died_is_adopted_over_null_fields(tmp_path):
    """The reader allows null for updated_at and stage (a GPU may not have them yet); the
    launch that adopts a worker's unrecorded checkpoint read them as numbers (TypeError)."""
    from launcher.cli import main as cli_main
    from launcher.paths import metrics_path
    from launcher.files import sha256_file
    from launcher.pod.events import EventLog, read_events
    from launcher.supervise.plan import load_plan
    from launcher.supervise.custodian import CheckpointCustodian
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    plan, _ = load_plan(pod, 2, None, "0")
    ckpt = pod / "checkpoints" / "fractus_1b_gpu0.pt"
    ckpt.parent.mkdir(exist_ok=True)
    ckpt.write_bytes(b"weights at token 640")
    write(pod / plan.config.manifest, {"gpu_0": {"start_token": 0, "updated_at": None,
                                                 "stage": None}})
    (pod / metrics_path(0)).parent.mkdir(parents=True, exist_ok=True)
    (pod / metrics_path(0)).write_text(json.dumps({
        "event": "checkpoint", "ts": 1.0, "next_token": 640, "step": 10, "ema_tf": 4.5,
        "lb": 14.0, "path": str(ckpt), "sha256": sha256_file(ckpt)}) + "\n")
    manifest = read_manifest(pod / plan.config.manifest)
    CheckpointCustodian.for_plan(plan, manifest, EventLog(pod)).reconcile(plan.stage)
    entry = read_manifest(pod / plan.config.manifest).entries[0]
    assert (entry.start_token, entry.checkpoint, entry.stage) == \
        (640, "checkpoints/fractus_1b_gpu0.pt", 2)        # the launch's stage, not null
    assert [e["start_token"] for e in read_events(pod) if e["event"] == "manifest_reconciled"] \
        == [640]
