"""Data phases in the pod config, the manifest and the checkpoint identity check: `shards:`
as a list of phases (parsed once, every phase's shard resolved per GPU), the bad lists
refused in one line with nothing written, the entry's `phase` in both manifest layouts, and
the identity check that accepts the switch the launcher recorded and nothing else."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from launcher.cli import main as cli_main
from launcher.config.podconfig import PodConfig, load_pod_config
from launcher.pod.setup_init import missing_shards
from launcher.errors import UserError
from launcher.pod.ckpt_trust import check_entry
from launcher.pod.manifest import ManifestError, read_manifest, write_manifest

CONFIG = "fractus-pod.yaml"
MANIFEST = "checkpoints/RESUME_MANIFEST_8GPU.json"
TWO_PHASES = ["data/shard_gpu{i}.pt", {"shard": "data/shard_phase2_gpu{i}.npy",
                                       "name": "phase2"}]


@pytest.fixture(scope="module")
def pod_template(tmp_path_factory) -> Path:
    pod = tmp_path_factory.mktemp("template") / "pod"
    assert cli_main(["--pod-dir", str(pod), "init"]) == 0    # demo shards of one phase
    return pod


@pytest.fixture
def pod(tmp_path, pod_template) -> Path:
    shutil.copytree(pod_template, tmp_path / "pod")
    return tmp_path / "pod"


def set_shards(pod: Path, shards) -> None:
    data = yaml.safe_load((pod / CONFIG).read_text())
    data["shards"] = shards
    (pod / CONFIG).write_text(yaml.safe_dump(data))


def tree(pod: Path) -> dict:
    return {p.relative_to(pod).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(pod.rglob("*"))}


def refused(pod: Path, capsys) -> str:
    before = tree(pod)
    code = cli_main(["--pod-dir", str(pod), "launch", "--stage", "1", "--max-time", "5"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert tree(pod) == before, "the refusal changed the pod"
    return lines[0]


def test_a_phase_list_resolves_every_phase_shard_per_gpu():
    config = PodConfig(shards=TWO_PHASES)
    assert [(p.number, p.name) for p in config.phases] == [(1, "phase 1"), (2, "phase2")]
    assert config.shard_paths(3) == ["data/shard_gpu3.pt", "data/shard_phase2_gpu3.npy"]
    assert config.shard_path(3) == "data/shard_gpu3.pt"
    assert config.shard_path(3, 2) == "data/shard_phase2_gpu3.npy"
    with pytest.raises(ValueError, match="phase 3"):
        config.shard_path(3, 3)
    one = PodConfig()           # today's single pattern: one phase
    assert one.shard_paths(0) == [one.shard_path(0)] == ["data/shard_phase2_gpu0.npy"]


@pytest.mark.parametrize("shards, words", [
    ([], "empty list of phases"),
    (["data/a_gpu{i}.npy", "data/a_gpu{i}.npy"], "in two phases"),
    (["data/a_gpu{i}.npy", {"shard": "data/b.npy"}], "must contain {i}"),
    ([{"shard": "data/b_gpu{i}.npy", "nmae": "x"}], "unknown key(s) ['nmae']"),
    ([{"name": "x"}], "expected a shard pattern"),
    ({"shard": "data/b_gpu{i}.npy"}, "a path pattern or a list of phases"),
], ids=["empty", "twice", "no-i", "typo", "no-shard", "mapping"])
def test_a_bad_phase_list_is_one_line_and_nothing_is_written(pod, capsys, shards, words):
    set_shards(pod, shards)
    assert words in refused(pod, capsys)


def test_a_phase_naming_a_missing_shard_is_refused_at_launch(pod, capsys):
    """Phase 1's shards are there; phase 2's are not: refused before training starts, not
    when phase 1 ends hours later."""
    set_shards(pod, ["data/shard_phase2_gpu{i}.npy", "data/later_gpu{i}.npy"])
    line = refused(pod, capsys)
    assert "2 token shard(s) missing: data/later_gpu0.npy, data/later_gpu1.npy" in line, line
    assert missing_shards(pod, load_pod_config(pod)) == ["data/later_gpu0.npy",
                                                     "data/later_gpu1.npy"]


@pytest.mark.parametrize("layout", ["current", "older"])
def test_the_phase_is_in_the_manifest_in_the_users_layout(tmp_path, layout):
    path = tmp_path / "manifest.json"
    user = ({"gpu_0": {"start_token": 640, "checkpoint": "c.pt", "note": 1}} if layout ==
            "current" else {"gpus": {"0": {"start_token": 640, "tokens_processed": 640,
                                           "last_loss": 5.1, "checkpoint": "c.pt"}}})
    path.write_text(json.dumps(user))
    manifest = read_manifest(path)
    write_manifest(manifest)
    assert "phase" not in path.read_text()       # one phase: the user's file as it was
    manifest.entries[0].switch_phase(2, "data/shard_phase2_gpu0.npy")
    write_manifest(manifest)
    data = json.loads(path.read_text())
    entry = data["gpu_0"] if layout == "current" else data["gpus"]["0"]
    assert (entry["start_token"], entry["phase"], entry["shard"], entry["checkpoint"]) == \
        (0, 2, "data/shard_phase2_gpu0.npy", "c.pt")
    if layout == "older":        # their fields first, in their order, kept equal
        assert list(entry)[:4] == ["start_token", "tokens_processed", "last_loss", "checkpoint"]
        assert entry["tokens_processed"] == 0
    assert read_manifest(path).entries[0].position == (2, 0)


def _checkpoint(path: Path, shard: str, phase: int, next_token: int, gpu: int = 0) -> None:
    """A full checkpoint's identity (train_state), with no tensors: check_entry reads it
    only (no model given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state": {}, "config": None, "optimizer_state": {},
                "train_state": {"format": 2, "next_token": next_token, "step": 3,
                                "ema_tf": 1.0, "ema_ss": None, "rng": {}, "shard": shard,
                                "phase": phase, "gpu": gpu, "run_id": None}}, path)


@pytest.mark.parametrize("ckpt_shard, ckpt_phase, gpu, accepted", [
    ("data/shard_gpu0.pt", 1, 0, True),               # the switch the launcher recorded
    ("data/shard_phase2_gpu0.npy", 1, 0, False),      # phase 1 on phase 2's shard
    ("data/shard_gpu0.pt", 2, 0, False),              # phase 1's shard, claims phase 2
    ("data/shard_gpu1.pt", 1, 1, False),              # another GPU's end of phase 1
], ids=["switch", "wrong-shard", "wrong-phase", "other-gpu"])
def test_the_identity_check_accepts_the_recorded_switch_only(tmp_path, ckpt_shard, ckpt_phase,
                                                             gpu, accepted):
    from fractus.train.checkpoint import is_full
    _checkpoint(tmp_path / "c.pt", ckpt_shard, ckpt_phase, next_token=4096, gpu=gpu)
    assert is_full(torch.load(tmp_path / "c.pt", weights_only=True))
    (tmp_path / "m.json").write_text(json.dumps({"gpu_0": {
        "start_token": 0, "phase": 2, "shard": "data/shard_phase2_gpu0.npy",
        "checkpoint": "c.pt"}}))
    manifest = read_manifest(tmp_path / "m.json")
    config = PodConfig(shards=TWO_PHASES)
    if accepted:
        check_entry(manifest, tmp_path, 0, config.shard_path)
    else:
        with pytest.raises(ManifestError):
            check_entry(manifest, tmp_path, 0, config.shard_path)


def test_a_manifest_phase_past_the_configs_phases_is_refused(tmp_path):
    from launcher.pod.manifest import phase_shard
    (tmp_path / "m.json").write_text(json.dumps({"gpu_0": {"start_token": 5, "phase": 3}}))
    with pytest.raises(ManifestError, match="data phase 3 .* list that phase's shard"):
        phase_shard(read_manifest(tmp_path / "m.json"), 0, PodConfig(shards=TWO_PHASES).shard_path)
    assert isinstance(ManifestError("x"), UserError)


def _switched_manifest(tmp_path: Path):
    (tmp_path / "m.json").write_text(json.dumps({"gpu_0": {
        "start_token": 4096, "checkpoint": "c.pt", "shard": "data/shard_gpu0.pt"}}))
    manifest = read_manifest(tmp_path / "m.json")
    manifest.entries[0].switch_phase(2, "data/shard_phase2_gpu0.npy")
    return manifest


def test_progress_compares_by_phase_then_token(tmp_path):
    """Token 64 of phase 2 is after token 4096 of phase 1; a late phase-1 checkpoint event
    (one a dead launcher missed, read again) never moves a switched GPU back."""
    from launcher.pod.manifest import BackwardsError, apply_checkpoint
    manifest = _switched_manifest(tmp_path)
    late = {"next_token": 4096, "phase": 1, "sha256": "a" * 64, "path": "old.pt"}
    behind = r"phase 1 token 4096 is behind the manifest \(phase 2 token 0\)"
    with pytest.raises(BackwardsError, match=behind):
        apply_checkpoint(manifest, 0, late, 1, tmp_path, "data/shard_gpu0.pt")
    on = {"next_token": 64, "phase": 2, "sha256": "b" * 64, "path": "new.pt", "ema_tf": 1.0}
    assert apply_checkpoint(manifest, 0, on, 1, tmp_path, "data/shard_phase2_gpu0.npy")
    entry = manifest.entries[0]
    assert (entry.position, entry.shard, entry.checkpoint) == \
        ((2, 64), "data/shard_phase2_gpu0.npy", "new.pt")


def test_a_rollback_to_an_earlier_phase_takes_that_phase_and_its_shard(tmp_path):
    manifest = _switched_manifest(tmp_path)
    entry = manifest.entries[0]
    entry.roll_back({"next_token": 2048, "sha256": "c" * 64, "path": "r.pt"}, stage=1)
    assert entry.position == (1, 2048) and entry.shard is None    # the config's phase 1 shard
    write_manifest(manifest)
    assert json.loads((tmp_path / "m.json").read_text())["gpu_0"]["phase"] == 1


def test_a_push_names_the_switch_once_it_resumes_from_the_pushed_checkpoint(tmp_path):
    manifest = _switched_manifest(tmp_path)
    entry = manifest.entries[0]
    entry["checkpoint_sha256"] = "a" * 64
    end_of_phase_one = {"sha256": "a" * 64, "next_token": 4096, "stage": 1}
    pushed = entry.as_pushed(end_of_phase_one, "checkpoints/fractus_1b_gpu0.pt",
                             "data/shard_gpu0.pt")
    assert (pushed.position, pushed.shard) == ((2, 0), "data/shard_phase2_gpu0.npy")
    older = {"sha256": "b" * 64, "next_token": 2048, "stage": 1}     # the newest passed
    pushed = entry.as_pushed(older, "checkpoints/fractus_1b_gpu0.pt", "data/shard_gpu0.pt")
    assert (pushed.position, pushed.shard) == ((1, 2048), "data/shard_gpu0.pt")


def test_a_launch_needs_the_current_and_every_later_phase_shard(pod):
    """What `launch` fetches (with `data:`) and refuses when missing: per GPU its current
    phase's shard and the later ones', never a phase it has left."""
    from launcher.supervise.launch_shards import shard_paths
    from launcher.supervise.plan import load_plan
    set_shards(pod, TWO_PHASES)
    (pod / MANIFEST).write_text(json.dumps({"gpu_1": {"start_token": 0, "phase": 2}}))
    plan, manifest = load_plan(pod, 1, None, None)
    assert shard_paths(plan, manifest) == ["data/shard_gpu0.pt", "data/shard_phase2_gpu0.npy",
                                           "data/shard_phase2_gpu1.npy"]
