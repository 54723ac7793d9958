"""Progress of long operations (launcher/pod/progress.py) on stdout without a terminal: a quick
operation prints nothing, a slow one prints its lines; off the main thread nothing. And the
real sites: merge and hub pull (the canary's: tests/test_canary.py)."""

from __future__ import annotations

import threading

import pytest
import torch

import launcher.pod.progress
from launcher.cli import main as cli_main
from launcher.hub import open_store
from launcher.pod.progress import progress


@pytest.fixture
def every_line(monkeypatch):
    monkeypatch.setattr(launcher.pod.progress, "PLAIN_FIRST_S", 0.0)
    monkeypatch.setattr(launcher.pod.progress, "PLAIN_EVERY_S", 0.0)


def test_quick_operation_prints_nothing(capsys):
    with progress("hashing 2 checkpoint(s)", 10, "bytes") as task:
        task.advance(10)
    assert capsys.readouterr() == ("", "")


def test_slow_operation_prints_its_progress(capsys, every_line):
    with progress("hashing 2 checkpoint(s)", 3e9, "bytes") as task:
        task.advance(1.5e9)
        task.update(description="hashing 2 checkpoint(s) now", advance=1.5e9)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("hashing 2 checkpoint(s): 1.50 GB/3.00 GB (50%), ")
    assert lines[-1].startswith("hashing 2 checkpoint(s) now: 3.00 GB/3.00 GB (100%), done in")


def test_off_the_main_thread_nothing_is_shown(capsys, every_line):
    def push():
        with progress("hub push", 2, "files") as task:
            task.update(advance=2)
    thread = threading.Thread(target=push)
    thread.start()
    thread.join()
    assert capsys.readouterr() == ("", "")


def _checkpoint(path, value: float):
    torch.save({"model_state": {"w": torch.full((4,), value)}, "config": {}}, path)
    return path


def test_merge_shows_each_checkpoint(tmp_path, capsys, every_line):
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--no-data"]) == 0
    (pod / "checkpoints").mkdir(exist_ok=True)
    from launcher.pod.manifest import ManifestEntry, read_manifest, write_manifest
    manifest = read_manifest(pod / "checkpoints" / "RESUME_MANIFEST_8GPU.json")
    for gpu in (0, 1):
        _checkpoint(pod / "checkpoints" / f"fractus_1b_gpu{gpu}.pt", float(gpu))
        manifest.add_entry(gpu, ManifestEntry(
            start_token=0, checkpoint=f"checkpoints/fractus_1b_gpu{gpu}.pt"))
    write_manifest(manifest)
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "merge"]) == 0
    out = capsys.readouterr().out
    assert "merging: adding fractus_1b_gpu1.pt: 1/2 checkpoints (50%)" in out
    assert "merging: writing FRACTUS_1B_8GPU_MERGED.pt: 2/2 checkpoints (100%), done in" in out


def test_hub_pull_shows_each_file(tmp_path, capsys, every_line):
    pod = tmp_path / "pod"
    (pod / "checkpoints").mkdir(parents=True)
    files = [f"checkpoints/fractus_1b_gpu{gpu}.pt" for gpu in (0, 1)]
    for gpu, rel in enumerate(files):
        (pod / rel).write_bytes(bytes([gpu]) * 200_000)
    store = open_store("file://hub", pod)
    revision = store.push(files, "two files")
    for rel in files:
        (pod / rel).unlink()
    capsys.readouterr()
    store.pull(revision=revision)
    out = capsys.readouterr().out
    assert f"hub pull {revision[:12]}: checkpoints/fractus_1b_gpu1.pt: 0.2 MB/0.4 MB (50%)" in out
    assert "0.4 MB/0.4 MB (100%), done in" in out
