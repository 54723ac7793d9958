"""The AR probe works on every checkpoint the worker can train from (issue 9, item 6).

One model's weights saved the ways the user's run holds them: a v1 file (`_orig_mod.`
prefixes, the v1 TARGET keys and no vocab_size, 50257 implied, the head in
tokens_processed), the merged brain (launcher/hub/merge.py, no head), a bare state_dict (no
config: the pod's `model`), and fractus-pod's full checkpoint. Each must probe to the
numbers of the same weights, in this process, through `python -m fractus.eval.probe`, and
through `fractus-pod probe --gpu i` on a pod whose manifest is the tracker's
`{"gpu_i": {"start_token": N}}`; and the launcher's own stage baseline probe on an adopted
replica of the user's run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fractus.config import EngineConfig
from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.data import synth
from fractus.eval.probe import ProbeConfig, probe_checkpoint
from launcher.cli import main as cli_main
from launcher.hub.merge import merge_checkpoints
from tests.support.v1_run import START_TOKENS, v1_run
from tests.support.e2e import (BATCH, SEQ, TEST_CRITERIA, Launcher, events_of,  # noqa: F401
                               launchers)

REPO = Path(__file__).resolve().parents[1]
# The v1 trainer's TARGET keys at a tiny size; no vocab_size, as in the user's files.
V1_TARGET = dict(d_model=64, n_heads=2, d_head=32, n_levels=2, n_oscillators=8,
                 coupling_rank=4, n_experts=8, top_k=2, expert_d_ff=64, siren_rank=16,
                 n_layers=2)
HEAD = 5_000
NUMBERS = ("ar", "ar_acc", "cold_tf", "ar_rows")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("formats")
    shard = synth(root, shards=1, tokens=20_000, vocab=512, seed=0)[0]
    torch.manual_seed(7)
    model = ContinuousThoughtEngine.from_config(EngineConfig(**V1_TARGET))
    assert model.config.vocab_size == 50257
    model.reset_thought(4)          # carried buffers at the v1 batch, as the user's files hold
    state = model.state_dict()
    v1 = {"model_state": {f"_orig_mod.{k}": v for k, v in state.items()},
          "config": {**V1_TARGET, "gpu": 0, "boost": True, "batch": 4, "lr": 7e-4,
                     "ss_rate": 0.25, "tokens_processed": HEAD}}
    paths = {"shard": shard, "v1": root / "fractus_1b_gpu0.pt", "bare": root / "bare.pt",
             "merged": root / "FRACTUS_1B_STAGE2_MERGED.pt", "model_json": root / "v1.json"}
    torch.save(v1, paths["v1"])
    torch.save(state, paths["bare"])
    merge_checkpoints([paths["v1"], paths["v1"]], paths["merged"])   # the mean of x and x is x
    paths["model_json"].write_text(json.dumps(V1_TARGET))
    paths["full"] = {"model_state": state,
                     "config": {**model.config.to_dict(), "tokens_processed": HEAD},
                     "train_state": {"next_token": HEAD}, "optimizer_state": {}}
    return paths


def numbers(result) -> tuple:
    got = result if isinstance(result, dict) else result.__dict__
    return tuple(tuple(got[k]) if k == "ar_rows" else got[k] for k in NUMBERS)


def close(got: tuple, want: tuple) -> bool:
    """Equal up to float reduction order (the probe process runs on one thread)."""
    flat = lambda t: [x for v in t for x in (v if isinstance(v, tuple) else (v,))]  # noqa: E731
    return flat(got) == pytest.approx(flat(want), rel=1e-5, abs=1e-6)


def test_every_format_probes_to_the_numbers_of_its_weights(files):
    full = probe_checkpoint(files["full"], files["shard"])
    assert full.start == HEAD and full.vocab_size == 50257 and len(full.ar_rows) == full.rows
    v1 = probe_checkpoint(files["v1"], files["shard"])          # head from tokens_processed
    assert v1.next_token == HEAD and numbers(v1) == numbers(full)
    merged = probe_checkpoint(files["merged"], files["shard"], head=HEAD)
    assert numbers(merged) == numbers(full)
    bare = probe_checkpoint(files["bare"], files["shard"], head=HEAD,
                            model_config=EngineConfig(**V1_TARGET))
    assert numbers(bare) == numbers(full) and bare.next_token is None
    with pytest.raises(ValueError, match="bare state_dict"):
        probe_checkpoint(files["bare"], files["shard"], head=HEAD)
    with pytest.raises(ValueError, match="no train head"):
        probe_checkpoint(files["bare"], files["shard"], model_config=EngineConfig(**V1_TARGET))


def probe_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fractus.eval.probe", *args, "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_probe_module_reads_the_model_of_a_bare_state_dict_from_model(files):
    expected = probe_checkpoint(files["full"], files["shard"], ProbeConfig(rows=2))
    done = probe_cli("--checkpoint", str(files["bare"]), "--shard", str(files["shard"]),
                     "--head", str(HEAD), "--rows", "2", "--model", str(files["model_json"]))
    assert done.returncode == 0, done.stderr
    assert close(numbers(json.loads(done.stdout)), numbers(expected))
    refused = probe_cli("--checkpoint", str(files["bare"]), "--shard", str(files["shard"]),
                        "--head", str(HEAD))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert "bare state_dict" in line and "--model" in line


def test_fractus_pod_probe_on_the_users_files(files, tmp_path, capsys):
    """The tracker's manifest names no checkpoint: GPU 0 resumes from its v1 file, GPU 1
    from a bare state_dict (config: the pod's model), both at the manifest's start token."""
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["model"] = "v1.json"             # relative to the pod, as the workers read it
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    (pod / "v1.json").write_text(files["model_json"].read_text())
    for gpu in (0, 1):
        (pod / "data" / f"shard_phase2_gpu{gpu}.npy").write_bytes(files["shard"].read_bytes())
    (pod / "checkpoints" / "fractus_1b_gpu0.pt").write_bytes(files["v1"].read_bytes())
    (pod / "checkpoints" / "fractus_1b_gpu1.pt").write_bytes(files["bare"].read_bytes())
    (pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json").write_text(
        json.dumps({"gpu_0": {"start_token": HEAD}, "gpu_1": {"start_token": HEAD}}))
    expected = numbers(probe_checkpoint(files["full"], files["shard"]))
    capsys.readouterr()
    for gpu in (0, 1):
        assert cli_main(["--pod-dir", str(pod), "probe", "--gpu", str(gpu), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["start"] == HEAD and close(numbers(report), expected), report


def test_the_launchers_stage_baseline_on_an_adopted_v1_run(tmp_path, launchers):
    """Seen on the user's run: the stage baseline was Inconclusive ("no train head"). The
    launcher's baseline probe of each GPU's v1 file runs at the manifest's start token."""
    run = v1_run(tmp_path / "run")
    originals = {gpu: torch.load(run / f"checkpoints/fractus_1b_gpu{gpu}.pt", weights_only=True)
                 for gpu in (0, 1)}
    assert cli_main(["--pod-dir", str(run), "adopt", "--devices", "cpu:2"]) == 0
    config = yaml.safe_load((run / "fractus-pod.yaml").read_text())
    config["env"] = {"SEQ": str(SEQ), "BATCH": str(BATCH)}
    config.update({"save_every": 2, "log_every": 1, "poll_interval_s": 0.2})
    (run / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    (run / "manifests" / "trusted_loss.yaml").write_text(
        yaml.safe_dump({**TEST_CRITERIA, "probe": {"every": 1, "band": 1e9}}))
    launcher = Launcher(run, "--stage", "1", "--max-steps", "2")
    launchers.append(launcher)
    assert launcher.wait(300) == 0, launcher.output()
    for gpu in (0, 1):
        (baseline,) = events_of(run, "probe", gpu=gpu, role="baseline")
        assert baseline["status"] == "baseline", baseline["reason"]
        here = probe_checkpoint(originals[gpu], run / f"data/shard_gpu{gpu}.pt",
                                head=START_TOKENS[gpu])
        assert baseline["ar"] == pytest.approx(here.ar, rel=1e-5)
        assert len(baseline["ar_rows"]) == here.rows
