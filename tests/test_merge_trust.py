"""`fractus-pod merge` holds the launch's trust rules (issue 16 item 20): a checkpoint
outside the pod, another GPU's or another run's, or one holding NaN is refused in one line
(exit 2) and no merged brain is written. A real tiny pod trained 3 steps by the real worker
(tests/support/pods.py), copied per case."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from launcher.cli import main as cli_main
from launcher.hub.merge import is_carried_state
from launcher.pod.manifest import RUN_ID_KEY
from tests.support.trusted_pod import CKPT, MANIFEST, manifest_of, pod, rewrite_checkpoint

OUT = "checkpoints/FRACTUS_1B_8GPU_MERGED.pt"
__all__ = ["pod"]     # the fixture, imported for pytest


def edit_manifest(pod: Path, edit) -> None:
    data = manifest_of(pod)
    edit(data)
    (pod / MANIFEST).write_text(json.dumps(data))


def merge_refused(pod: Path, capsys, *words: str) -> None:
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "merge"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for word in words:
        assert word in err, err
    assert not (pod / OUT).exists()


def test_merge_of_the_gpus_own_checkpoints_is_written(pod, capsys):
    assert cli_main(["--pod-dir", str(pod), "merge"]) == 0
    assert (pod / OUT).is_file()


def test_a_checkpoint_holding_nan_is_not_merged(pod, capsys):
    def poison(ck):
        state = ck["model_state"]
        key = next(k for k, t in state.items()
                   if t.is_floating_point() and t.numel() > 1 and not is_carried_state(k))
        state[key] = state[key].clone()
        state[key].view(-1)[0] = float("nan")
    rewrite_checkpoint(pod, poison)
    merge_refused(pod, capsys, "NaN", "fractus_1b_gpu0.pt")


def test_another_gpus_checkpoint_is_not_merged(pod, capsys):
    shutil.copyfile(pod / CKPT, pod / "checkpoints" / "fractus_1b_gpu1.pt")
    edit_manifest(pod, lambda d: d.__setitem__("gpu_1", {
        **d["gpu_0"], "checkpoint": "checkpoints/fractus_1b_gpu1.pt"}))
    merge_refused(pod, capsys, "gpu_1", "written by GPU 0")


def test_another_runs_checkpoint_is_not_merged(pod, capsys):
    rewrite_checkpoint(pod, lambda ck: ck["train_state"].update(run_id="another-run"))
    edit_manifest(pod, lambda d: d.__setitem__(RUN_ID_KEY, "this-run"))
    merge_refused(pod, capsys, "another-run", "this-run")


def test_a_checkpoint_outside_the_pod_is_not_merged(pod, tmp_path, capsys):
    outside = tmp_path / "outside.pt"
    shutil.move(pod / CKPT, outside)
    edit_manifest(pod, lambda d: d["gpu_0"].update(checkpoint=str(outside)))
    merge_refused(pod, capsys, str(outside), "outside the pod")
