"""Hub paths a new user takes (issue 10, items 15, 16, 19): `sync pull` never replaces the
pod's live state without --force and `status` flags a replaced checkpoint, `sync pull --from`
into a new folder, identical pushes skipped, an empty history said so.

Real files, a real file:// store and the real CLI (in-process `main`; output via capsys).
Checkpoints are written as the worker writes them (replaced atomically) with their events
recorded in the index and manifest, as the launcher does (tests/support/hub_pod.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from launcher.files import sha256_file
from tests.support.e2e import events_of
from tests.support.hub_pod import CKPT, MANIFEST, add_passed, pod, run  # noqa: F401 (fixture)


# ---- 19 ------------------------------------------------------------------------------
def test_empty_history_says_so_and_identical_pushes_are_skipped(pod, capsys):
    code, out, _ = run(capsys, pod, "sync", "history")
    assert code == 0 and "no revisions" in out
    add_passed(pod, 0, 100)
    add_passed(pod, 1, 100)
    code, out, err = run(capsys, pod, "sync", "push")
    assert code == 0, err
    first = out.split("pushed revision ")[1].split()[0]
    code, out, err = run(capsys, pod, "sync", "push")
    assert code == 0, err
    assert "skipped" in out and first in out
    code, out, _ = run(capsys, pod, "sync", "history")
    assert len(out.strip().splitlines()) == 1 and out.startswith(first[:12])
    (skip,) = events_of(pod, "sync_skipped")
    assert skip["revision"] == first
    # New content is pushed again.
    add_passed(pod, 0, 200)
    code, out, err = run(capsys, pod, "sync", "push")
    assert code == 0 and "pushed revision" in out, err
    code, out, _ = run(capsys, pod, "sync", "history")
    assert len(out.strip().splitlines()) == 2


# ---- 16 ------------------------------------------------------------------------------
def test_sync_pull_from_a_hub_into_a_new_folder(pod, tmp_path, capsys, monkeypatch):
    add_passed(pod, 0, 100)
    assert run(capsys, pod, "sync", "push")[0] == 0
    hub_dir = pod / "hub"
    new = tmp_path / "fresh" / "copy"                  # does not exist yet
    monkeypatch.chdir(tmp_path)                        # a relative URL means from here
    code, out, err = run(capsys, new, "sync", "pull", "--from", "file://pod/hub")
    assert code == 0, err
    assert f"pulled {CKPT.format(0)}" in out and f"pulled {MANIFEST}" in out
    assert sha256_file(new / CKPT.format(0)) == sha256_file(pod / CKPT.format(0))
    # The pulled config points at the hub it came from: the next pull needs no --from.
    assert yaml.safe_load((new / "fractus-pod.yaml").read_text())["hub"] == \
        f"file://{hub_dir.resolve()}"
    code, out, err = run(capsys, new, "sync", "history")
    assert code == 0 and len(out.strip().splitlines()) == 1, err
    # Without a config and without --from, the one line says what to give.
    code, _, err = run(capsys, tmp_path / "empty", "sync", "pull")
    assert code == 2 and "--from" in err and err.startswith("error: ")


# ---- 15 ------------------------------------------------------------------------------
def test_pull_of_an_old_revision_never_replaces_the_live_checkpoint_without_force(pod, capsys):
    add_passed(pod, 0, 100)
    code, out, _ = run(capsys, pod, "sync", "push")
    old_rev = out.split("pushed revision ")[1].split()[0]
    newest = add_passed(pod, 0, 200)
    assert run(capsys, pod, "sync", "push")[0] == 0
    live = pod / CKPT.format(0)
    manifest_before = (pod / MANIFEST).read_bytes()

    code, out, err = run(capsys, pod, "sync", "pull", "--revision", old_rev, CKPT.format(0))
    assert code == 2 and err.count("\n") == 1 and "--force" in err and CKPT.format(0) in err
    assert sha256_file(live) == newest["sha256"]
    assert (pod / MANIFEST).read_bytes() == manifest_before
    # Pulling everything (manifest included) is refused the same way, nothing written.
    code, _, err = run(capsys, pod, "sync", "pull", "--revision", old_rev)
    assert code == 2 and "refusing to overwrite" in err
    assert sha256_file(live) == newest["sha256"]
    assert (pod / MANIFEST).read_bytes() == manifest_before

    status = json.loads(_status(pod, capsys))
    assert [r["checkpoint_problem"] for r in status["gpus"]] == [None, None]

    code, out, err = run(capsys, pod, "sync", "pull", "--revision", old_rev, "--force",
                         CKPT.format(0))
    assert code == 0, err
    assert sha256_file(live) != newest["sha256"]
    status = json.loads(_status(pod, capsys))
    gpu0 = [r for r in status["gpus"] if r["gpu"] == 0][0]
    assert "does not hold the bytes the manifest records" in gpu0["checkpoint_problem"]
    code, out, _ = run(capsys, pod, "status")
    assert "does not hold the bytes the manifest records" in out


def _status(pod: Path, capsys) -> str:
    code, out, err = run(capsys, pod, "status", "--json")
    assert code == 0, err
    return out
