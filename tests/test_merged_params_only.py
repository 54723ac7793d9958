"""A merged brain written from the parameters alone (no constant buffers such as
`attn.level_offsets` and `moe.expert_phases`, no tied `output_head.weight` beside
`observe.weight`), as the user's own loader (scripts/smoke_load_merged.py of the reference)
accepts it: the probe, adopt --init-new-from and the launch's check accept it, fill what
the model's construction computes, say so in one line, and still refuse a missing learned
parameter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fractus.continuous_engine import ContinuousThoughtEngine
from fractus.legacy import load_engine
from launcher.cli import main as cli_main
from launcher.pod.ckpt_trust import read_identity
from tests.support.pods import copy_pod
from tests.support.v1_run import v1_run, write_pt_shard, write_v1_checkpoint

REPO = Path(__file__).resolve().parents[1]
SHARD = "data/shard_phase2_gpu0.npy"
MERGED = "checkpoints/FRACTUS_1B_STAGE2_MERGED.pt"


def params_only(source: Path, dest: Path, drop: tuple[str, ...] = ()) -> dict:
    """`source`'s model written as its parameters alone (each tensor once, by its first
    name), with its config; `drop`: parameters left out too."""
    ck = torch.load(source, map_location="cpu", weights_only=True)
    model = load_engine(ContinuousThoughtEngine, ck)
    state = {k: v.clone() for k, v in model.named_parameters() if k not in drop}
    torch.save({"model_state": state, "config": ck["config"]}, dest)
    return state


@pytest.fixture(scope="module")
def pod(worker_trained_pod, tmp_path_factory) -> Path:
    return copy_pod(worker_trained_pod, tmp_path_factory.mktemp("pod") / "pod")


def fractus_pod(pod: Path, *args: str):
    return subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_probe_fills_the_buffers_and_tied_name_and_computes_the_same(pod):
    full = pod / "checkpoints" / "fractus_1b_gpu0.pt"
    state = params_only(full, pod / MERGED)
    assert "output_head.weight" not in state and "blocks.0.attn.level_offsets" not in state
    done = fractus_pod(pod, "probe", "--checkpoint", MERGED, "--shard", SHARD, "--head", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("filled from")]
    assert "blocks.*.attn.level_offsets" in line and "blocks.*.moe.expert_phases" in line
    assert "output_head.weight (tied to observe.weight)" in line
    # the same numbers as the complete file: what was filled is what construction computes
    reference = fractus_pod(pod, "probe", "--checkpoint", str(full), "--shard", SHARD,
                            "--head", "0")
    assert done.stdout.splitlines()[0].split(": ", 1)[1] == \
        reference.stdout.splitlines()[0].split(": ", 1)[1]
    model = load_engine(ContinuousThoughtEngine, str(pod / MERGED))
    complete = load_engine(ContinuousThoughtEngine, str(full)).state_dict()
    assert all(torch.equal(v, complete[k]) for k, v in model.state_dict().items()
               if not k.endswith(("attn_S", "attn_z", "kuramoto_phases", "thought_state",
                                  "last_lb_loss")))
    assert model.output_head.weight is model.observe.weight


def test_a_missing_learned_parameter_is_still_refused_in_one_line(pod):
    params_only(pod / "checkpoints" / "fractus_1b_gpu0.pt", pod / "checkpoints" / "cut.pt",
                drop=("blocks.0.attn.w_out",))
    done = fractus_pod(pod, "probe", "--checkpoint", "checkpoints/cut.pt", "--shard", SHARD)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "missing ['blocks.0.attn.w_out']" in line and "Traceback" not in done.stderr
    with pytest.raises(ValueError, match=r"missing \['blocks.0.attn.w_out'\]"):
        read_identity(pod / "checkpoints" / "cut.pt", "tiny", pod)
    # both names of a tied weight missing: a learned parameter is missing
    params_only(pod / "checkpoints" / "fractus_1b_gpu0.pt", pod / "checkpoints" / "untied.pt",
                drop=("observe.weight",))
    with pytest.raises(ValueError, match="observe.weight"):
        read_identity(pod / "checkpoints" / "untied.pt", "tiny", pod)


def test_adopt_init_new_from_a_params_only_merged_brain(tmp_path, capsys):
    run = v1_run(tmp_path / "run")
    write_pt_shard(run / "data/shard_gpu2.pt", seed=2)
    write_v1_checkpoint(run / "full.pt", 0, seed=99)
    params_only(run / "full.pt", run / MERGED)
    assert cli_main(["--pod-dir", str(run), "adopt", "--devices", "cpu:3",
                     "--init-new-from", MERGED]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if "filled from the model's construction" in ln]
    assert line.startswith(f"gpu 2: {MERGED}: filled from") and "observe.weight" in line
    # the launch's check of the file (its tensors against the pod's model) accepts it
    from launcher.config.podconfig import load_pod_config
    read_identity(run / MERGED, load_pod_config(run).model, run)
