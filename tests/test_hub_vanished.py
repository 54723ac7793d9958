"""A file:// hub store that held this pod's revisions and vanished is an error, visible in
the push, the events and `status`, never silently recreated empty (issue 10, item 10)."""

from __future__ import annotations

import shutil

from launcher.cli import main as cli_main
from launcher.pod.events import read_events
from launcher.config.podconfig import load_pod_config
from tests.support.pod_history import pod_with_history


def test_vanished_file_store_is_an_error_not_recreated(tmp_path, capsys):
    pod = pod_with_history(tmp_path)
    assert cli_main(["--pod-dir", str(pod), "sync", "push", "-m", "first"]) == 0
    capsys.readouterr()
    shutil.rmtree(pod / "hub")

    assert cli_main(["--pod-dir", str(pod), "sync", "push", "-m", "again"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "held this pod's revisions" in err, err
    assert "empty or gone" in err and not (pod / "hub").exists()

    # A launcher starting on this pod says so at once: an event, and `status`.
    from launcher.pod.ckpt_index import CheckpointIndex
    from launcher.pod.events import EventLog
    from launcher.pod.manifest import read_manifest
    from launcher.hub.sync import HubSync, RunLease
    config = load_pod_config(pod)
    log = EventLog(pod)
    HubSync(pod, config, read_manifest(pod / config.manifest), CheckpointIndex(pod), log,
            RunLease(pod, log))
    (failed,) = [e for e in read_events(pod) if e["event"] == "sync_failed"]
    assert failed["reason"] == "launch" and "held this pod's revisions" in failed["error"]
    assert not (pod / "hub").exists()
    import json
    assert cli_main(["--pod-dir", str(pod), "status", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "held this pod's revisions" in report["sync"]["last_error"]

    # Pointing hub: at a new store is how to start over.
    text = (pod / "fractus-pod.yaml").read_text().replace("file://hub", "file://hub2")
    (pod / "fractus-pod.yaml").write_text(text)
    assert cli_main(["--pod-dir", str(pod), "sync", "push", "-m", "new store"]) == 0
    assert (pod / "hub2" / "refs" / "main").is_file()
