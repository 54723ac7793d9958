"""`fractus-pod adopt` on a replica of the user's run (tests/support/v1_run.py), then a real
launch: every GPU resumes with its checkpoint's weights, in its manifest shard, at its
manifest start_token (the first step's loss proves all three), with the user's decoy
`fractus/` package in the directory; the user's manifest reader sees the advance; the
original checkpoints outlive more saves than SAVE_KEEP; a fractus-pod checkpoint loads into
the reference engine the v1 way. Bad input: exit 2, one line per problem, nothing written."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.data import batch_from_window
from fractus.legacy import load_engine, strip_compiled_prefix
from fractus.nn import attention
from launcher.pod.adoption_baseline import read_adoption
from launcher.cli import main as cli_main
from tests.support.v1_run import (START_TOKENS, TARGET, V1_VOCAB, v1_run, write_pt_shard,
                                  write_v1_checkpoint)
from tests.support.e2e import (BATCH, SEQ, TEST_CRITERIA, TOKENS_PER_STEP, Launcher,
                               launchers, worker_records)

__all__ = ["launchers"]   # the fixture, imported for pytest
STEPS = 4


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def adopt(run: Path, *args: str) -> int:
    return cli_main(["--pod-dir", str(run), "adopt", *args])


def first_step_loss(checkpoint: Path, shard: Path, start: int) -> float:
    """The teacher-forced CE the checkpoint's weights give on the shard window at `start`
    (stage 1: dense CE, cumsum attention, the default gate temperature 2.5)."""
    model = load_engine(ContinuousThoughtEngine, checkpoint, batch_size=BATCH)
    model.set_gate_temperature(2.5)
    tokens = torch.load(shard, weights_only=True)[start:start + BATCH * SEQ + 1]
    chunk, target = batch_from_window(tokens, BATCH, SEQ)
    attention.set_attention_impl("cumsum")
    try:
        with torch.no_grad():
            logits, _ = model.tick_chunk_train(chunk)
    finally:
        attention.set_attention_impl(None)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)).item()


def load_the_v1_way(path: Path) -> tuple[ContinuousThoughtEngine, int, dict]:
    """What the reference trainer does with a checkpoint (its CKPT_IN load)."""
    ck = torch.load(path, map_location="cpu", weights_only=False)
    clean = strip_compiled_prefix(ck.get("model_state", ck))
    engine = ContinuousThoughtEngine(vocab_size=V1_VOCAB, **TARGET)
    own, loaded = engine.state_dict(), 0
    for key, value in clean.items():
        if key in own and own[key].shape == value.shape:
            own[key] = value
            loaded += 1
    engine.load_state_dict(own, strict=False)
    return engine, loaded, clean


# The user's own reader of each manifest layout, as their relaunch one-liners do it.
READERS = {
    "checkpoints/RESUME_MANIFEST_8GPU.json": lambda m, gpu: m[f"gpu_{gpu}"]["start_token"],
    "RESUME_MANIFEST.json": lambda m, gpu: m["gpus"][str(gpu)]["start_token"],
}


@pytest.mark.filterwarnings("ignore:carried state")   # v1's file at batch 1; the worker resets too
@pytest.mark.parametrize("pod_manifest", sorted(READERS))
def test_adopt_then_launch_resumes_every_gpu_exactly(tmp_path, launchers, capsys, pod_manifest):
    run = v1_run(tmp_path / "run")
    originals = {gpu: sha(run / f"checkpoints/fractus_1b_gpu{gpu}.pt") for gpu in (0, 1)}
    chosen = () if pod_manifest.startswith("checkpoints/") else ("--manifest", pod_manifest)
    assert adopt(run, "--devices", "cpu:2", *chosen) == 0
    out = capsys.readouterr().out
    for gpu in (0, 1):
        assert f"checkpoints/fractus_1b_gpu{gpu}.pt" in out and originals[gpu][:12] in out
        assert f"{START_TOKENS[gpu]:,}" in out
    config = yaml.safe_load((run / "fractus-pod.yaml").read_text())
    assert config["shards"] == "data/shard_gpu{i}.pt"
    assert config["manifest"] == pod_manifest
    assert json.loads((run / config["model"]).read_text()) == {"vocab_size": V1_VOCAB, **TARGET}
    assert "ALLOW_FRESH_START" not in config["env"]

    before = snapshot(run)
    assert adopt(run, "--devices", "cpu:2", *chosen) == 0         # idempotent
    assert snapshot(run) == before

    config["env"] = {"SEQ": str(SEQ), "BATCH": str(BATCH)}
    config.update({"save_every": 1, "save_keep": 2, "log_every": 1, "poll_interval_s": 0.2,
                   "stop_grace_s": 20.0})
    (run / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    (run / "manifests" / "trusted_loss.yaml").write_text(yaml.safe_dump(TEST_CRITERIA))
    launcher = Launcher(run, "--stage", "1", "--max-steps", str(STEPS))
    launchers.append(launcher)
    assert launcher.wait(300) == 0, launcher.output()

    written = json.loads((run / pod_manifest).read_text())
    for gpu in (0, 1):
        first = [r for r in worker_records(run, gpu) if r.get("type") == "metrics"][0]
        expected = first_step_loss(run / "checkpoints/adopted" / _kept(run, gpu).name,
                                   run / f"data/shard_gpu{gpu}.pt", START_TOKENS[gpu])
        assert first["tf"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert first["next_token"] == START_TOKENS[gpu] + TOKENS_PER_STEP
        advanced = START_TOKENS[gpu] + STEPS * TOKENS_PER_STEP
        assert READERS[pod_manifest](written, gpu) == advanced          # the user's reader
        if "gpus" in written:                  # kept in its layout, tokens_processed true
            assert written["gpus"][str(gpu)]["tokens_processed"] == advanced
            assert written["step_tokens"] == 256 and written["gpus"][str(gpu)]["last_loss"] == 30.3
        # STEPS saves > SAVE_KEEP: rotation pruned the original, the baseline keeps its bytes
        assert sha(_kept(run, gpu)) == originals[gpu]
        assert not any(sha(p) == originals[gpu]
                       for p in (run / "checkpoints").glob(f"fractus_1b_gpu{gpu}.pt*"))

    # Going back: the newest fractus-pod checkpoint loads into the reference engine as v1 does.
    newest = run / "checkpoints/fractus_1b_gpu0.pt"
    engine, loaded, clean = load_the_v1_way(newest)
    params = dict(engine.named_parameters())
    assert loaded >= len(params)      # every parameter (carried buffers: v1 resets them)
    assert all(torch.equal(params[k], clean[k]) for k in params)
    assert {k: v for k, v in torch.load(newest, weights_only=True)["config"].items()
            if k in TARGET} == TARGET


def _kept(run: Path, gpu: int) -> Path:
    (record,) = [r for r in read_adoption(run) if r["gpu"] == gpu]
    return run / record["kept"]


def _refused(run: Path, capsys, *args: str) -> list[str]:
    before = snapshot(run)
    assert adopt(run, *args) == 2
    assert snapshot(run) == before                       # nothing written
    err = capsys.readouterr().err.strip().splitlines()
    assert all(line.startswith("error: ") for line in err) and "Traceback" not in "".join(err)
    return err


def test_unknown_gpu_is_refused_unless_told_where_it_starts(tmp_path, capsys):
    run = v1_run(tmp_path / "run")
    write_pt_shard(run / "data/shard_gpu2.pt", seed=2)
    (line,) = _refused(run, capsys, "--devices", "cpu:3")
    assert line.startswith("error: gpu 2: not in RESUME_MANIFEST_8GPU.json, RESUME_MANIFEST.json")
    assert "--init-new-from" in line
    write_v1_checkpoint(run / "checkpoints/FRACTUS_1B_STAGE2_MERGED.pt", 0, seed=99)  # gpu 0
    assert adopt(run, "--devices", "cpu:3", "--init-new-from",
                 "checkpoints/FRACTUS_1B_STAGE2_MERGED.pt") == 0
    tracker = json.loads((run / "checkpoints/RESUME_MANIFEST_8GPU.json").read_text())
    assert tracker["gpu_2"] == {"start_token": 0,
                                "checkpoint": "checkpoints/FRACTUS_1B_STAGE2_MERGED.pt",
                                "shard": "data/shard_gpu2.pt"}
    assert tracker["gpu_0"] == {"start_token": START_TOKENS[0]}   # the user's entries as they were
    # launch accepts the merged brain (its config names GPU 0) as GPU 2's start at token 0
    from launcher.pod.ckpt_trust import check_entry
    from launcher.pod.manifest import read_manifest
    manifest = read_manifest(run / "checkpoints/RESUME_MANIFEST_8GPU.json")
    check_entry(manifest, run, 2, lambda gpu: f"data/shard_gpu{gpu}.pt")


def test_bad_runs_are_refused_one_line_per_problem(tmp_path, capsys):
    run = v1_run(tmp_path / "run")
    root = json.loads((run / "RESUME_MANIFEST.json").read_text())
    root["gpus"]["0"]["checkpoint"] = "checkpoints/gone.pt"          # a missing checkpoint
    (run / "RESUME_MANIFEST.json").write_text(json.dumps(root))
    write_pt_shard(run / "data/shard_gpu1.pt", seed=1, tokens=500)   # shorter than 640
    lines = _refused(run, capsys, "--devices", "cpu:2")
    assert len(lines) == 2
    assert "gpu 0" in lines[0] and "checkpoints/gone.pt does not exist" in lines[0]
    assert "gpu 1: start_token 640 is past the end of its shard data/shard_gpu1.pt (500" \
        in lines[1]


def test_a_checkpoint_with_another_config_is_refused(tmp_path, capsys):
    run = v1_run(tmp_path / "run")
    write_v1_checkpoint(run / "checkpoints/fractus_1b_gpu1.pt", 1, seed=3,
                        config={**TARGET, "n_experts": 4})
    (line,) = _refused(run, capsys, "--devices", "cpu:2")
    assert "gpu 1: checkpoint checkpoints/fractus_1b_gpu1.pt has another config than gpu 0's" \
        in line and "n_experts 4 vs 8" in line


def test_a_gpu_in_two_manifests_with_different_tokens_names_both(tmp_path, capsys):
    run = v1_run(tmp_path / "run")
    (run / "RESUME_MANIFEST_FINE.json").write_text(json.dumps(
        {"phase": "stage2_fine", "gpus": {"1": {"start_token": 960, "tokens_processed": 960}}}))
    (line,) = _refused(run, capsys, "--devices", "cpu:2")
    assert "gpu 1: start_token 640 in RESUME_MANIFEST_8GPU.json, RESUME_MANIFEST.json vs " \
           "start_token 960 in RESUME_MANIFEST_FINE.json" in line
    assert "--manifest" in line
    (run / "RESUME_MANIFEST_FINE.json").write_text(json.dumps(   # same token, another file
        {"gpus": {"1": {"start_token": 640, "checkpoint": "checkpoints/fractus_1b_gpu0.pt"}}}))
    (line,) = _refused(run, capsys, "--devices", "cpu:2")
    assert "gpu 1: checkpoint checkpoints/fractus_1b_gpu1.pt in RESUME_MANIFEST.json vs " \
           "checkpoint checkpoints/fractus_1b_gpu0.pt in RESUME_MANIFEST_FINE.json" in line
    assert adopt(run, "--devices", "cpu:2", "--manifest", "RESUME_MANIFEST.json") == 0
    assert yaml.safe_load((run / "fractus-pod.yaml").read_text())["manifest"] == \
        "RESUME_MANIFEST.json"


def test_launch_refuses_a_fresh_start_and_a_shard_other_than_the_manifests(tmp_path, capsys):
    run = v1_run(tmp_path / "run")
    assert adopt(run, "--devices", "cpu:2") == 0
    (run / "checkpoints/RESUME_MANIFEST_8GPU.json").write_text(json.dumps(
        {"gpu_0": {"start_token": 320}}))
    (run / "checkpoints/fractus_1b_gpu1.pt").unlink()
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(run), "launch", "--stage", "1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "gpu 1: RESUME_MANIFEST_8GPU.json does not list it" in line
    assert "ALLOW_FRESH_START" in line
    assert not (run / "logs/events.jsonl").exists() or "worker_start" not in \
        (run / "logs/events.jsonl").read_text()

    (run / "checkpoints/RESUME_MANIFEST_8GPU.json").write_text(json.dumps(
        {"gpu_0": {"start_token": 320, "shard": "data/shard_gpu1.pt"}}))
    assert cli_main(["--pod-dir", str(run), "launch", "--stage", "1", "--gpus", "0"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "gpu_0 trained on shard data/shard_gpu1.pt but the pod config's shards: names " \
           "data/shard_gpu0.pt" in line


def test_adopting_a_stage_3_run_suggests_the_launch_that_resumes_stage_3(tmp_path, capsys):
    """It used to suggest `launch --stage 1` (issue 16, item 14): plain `launch` resumes the
    stage the manifest records."""
    run = v1_run(tmp_path / "run")
    path = run / "checkpoints/RESUME_MANIFEST_8GPU.json"
    manifest = json.loads(path.read_text())
    for entry in manifest.values():
        entry["stage"] = 3
    path.write_text(json.dumps(manifest))
    assert adopt(run, "--devices", "cpu:2", "--manifest",
                 "checkpoints/RESUME_MANIFEST_8GPU.json") == 0
    (next_line,) = [line for line in capsys.readouterr().out.splitlines()
                    if line.startswith("next:")]
    assert next_line.endswith("launch (resumes at stage 3, the stage the manifest records)")


def test_adopting_offers_to_put_the_shards_on_the_hub(tmp_path, capsys):
    """An adopted run's shards live only on its disk (the user's corpus was lost with a
    dead pod): adopt names `data push` as the step that puts them on the hub."""
    run = v1_run(tmp_path / "run")
    assert adopt(run, "--devices", "cpu:2", "--manifest",
                 "checkpoints/RESUME_MANIFEST_8GPU.json") == 0
    (then,) = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("then:")]
    assert f"--pod-dir {run} data push --to hf://datasets/" in then
