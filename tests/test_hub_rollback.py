"""Issue 18: what the manifest says (a rollback by hand or automatic, a stage switch) reaches
the hub, so a pod rebuilt from it resumes where the pod is. Seen: `rollback --to-stage 2` on a
stage-3 pod, then `sync push` answered "skipped: revision ... already holds these
checkpoints", and `launch --from-hub` came back at stage 3.

Unit level over a real file:// store (fake checkpoint bytes), and end to end with the real
launcher, workers and `launch --from-hub` (tiny CPU pod)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from launcher.config.podconfig import load_pod_config
from launcher.hub import open_store
from launcher.hub.sync_state import read_sync_state
from launcher.hub.sync_push import push_now
from launcher.pod.ckpt_index import FAILED, PASSED, CheckpointIndex
from launcher.pod.manifest import read_manifest, write_manifest
from tests.support.e2e import (TOKENS_PER_STEP, Launcher, events_of,  # noqa: F401
                               launchers, make_pod, manifest_json, worker_records)
from tests.support.from_hub import launch_from_hub
from tests.support.hf_client import REPO_ID, quiet_hf_client  # noqa: F401  (fixture)
from tests.support.hub_manifest import manifest_on_hub
from tests.support.hub_pod import FAST_PASS, pod, write_checkpoint  # noqa: F401 (fixture)
from tests.support.hub_server import test_hub  # noqa: F401  (pytest fixture)


def checkpoint_at(pod: Path, gpu: int, token: int, stage: int, verdict: str) -> None:
    """A (fake) checkpoint of GPU `gpu` trained at `stage`, recorded as the launcher does."""
    manifest = read_manifest(pod / load_pod_config(pod).manifest)
    write_checkpoint(pod, CheckpointIndex(pod), manifest, gpu, token, verdict, stage=stage)
    write_manifest(manifest)


def pod_at_stage_3(pod: Path) -> None:
    """Two GPUs whose newest checkpoint, trained at stage 3, passed."""
    for gpu in (0, 1):
        checkpoint_at(pod, gpu, 100 * (gpu + 1), 3, PASSED)


def test_a_push_after_a_rollback_by_hand_is_not_skipped_and_holds_the_rolled_back_stage(
        pod, capsys):
    pod_at_stage_3(pod)
    config = load_pod_config(pod)
    first, _noted, skipped = push_now(pod, config, "at stage 3")
    assert not skipped
    assert manifest_on_hub(pod, first).recorded_stages() == [3]

    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "2"]) == 0
    said = capsys.readouterr().out
    unpushed = read_sync_state(pod).get("manifest_unpushed")

    # Same checkpoints, changed manifest: pushed, not skipped.
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 0
    assert "pushed revision" in capsys.readouterr().out
    # The rollback said the hub is behind, and recorded it until this push.
    assert "sync push" in said and unpushed["reason"] == "rollback by hand"
    second = open_store("file://hub", pod).head()
    assert second != first
    assert manifest_on_hub(pod, second).recorded_stages() == [2]
    assert read_sync_state(pod)["manifest_unpushed"] is None
    # Nothing changed since: the next push is skipped, no revision added.
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 0
    assert "skipped" in capsys.readouterr().out
    assert open_store("file://hub", pod).head() == second


def test_a_gpu_rolled_back_to_token_0_keeps_its_stage_on_the_hub(pod):
    """A GPU none of whose checkpoints passed starts over at token 0: the hub's manifest
    still records it (its stage is part of where the pod stands), with no checkpoint."""
    pod_at_stage_3(pod)
    checkpoint_at(pod, 2, 300, 3, "pending")
    config = load_pod_config(pod)
    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "2", "--gpu", "2"]) == 0
    revision, _noted, _skipped = push_now(pod, config, "after the rollback")
    on_hub = manifest_on_hub(pod, revision)
    assert (on_hub.entries[2].start_token, on_hub.entries[2].checkpoint) == (0, None)
    assert sorted(on_hub.entries) == [0, 1, 2] and on_hub.recorded_stages() == [2]


def test_the_next_launcher_pushes_a_rollback_made_while_none_ran_at_its_first_tick(pod):
    """No launcher ran to push the rollback by hand, and no `sync push` followed: the next
    launcher's sync pushes it at its first tick, not an interval later."""
    from launcher.hub.sync import HubSync, RunLease
    from launcher.pod.events import EventLog, read_events
    pod_at_stage_3(pod)
    config = load_pod_config(pod)
    push_now(pod, config, "at stage 3")
    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "2"]) == 0
    log = EventLog(pod)
    sync = HubSync(pod, config, read_manifest(pod / config.manifest), CheckpointIndex(pod),
                   log, RunLease(pod, log))        # sync interval: one hour
    sync.tick()
    assert sync.busy, "the rollback waits for the interval"
    sync.finish()                                  # waits for it; the stop push: skipped
    pushed = [e for e in read_events(pod) if e["event"] == "sync_pushed"]
    assert [e["reason"] for e in pushed] == ["by hand", "rollback by hand"]
    assert manifest_on_hub(pod, pushed[-1]["revision"]).recorded_stages() == [2]
    assert read_sync_state(pod)["manifest_unpushed"] is None


@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")
def test_a_rollback_by_hand_reaches_a_hub_through_the_real_client(test_hub, tmp_path,
                                                                   capsys):
    """The same by hand against the protocol-level test hub (tests/support/hub_server.py),
    through the real HfApi: the push after the rollback is a commit, and a pod pulled from
    the hub (`sync pull --from`) stands at the rolled-back stage and tokens."""
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    config_file = pod / "fractus-pod.yaml"
    config_file.write_text(config_file.read_text().replace("hub: file://hub",
                                                           f"hub: hf://{REPO_ID}"))
    pod_at_stage_3(pod)
    checkpoint_at(pod, 0, 150, 3, FAILED)         # newer than the passed one, failed
    config = load_pod_config(pod)
    push_now(pod, config, "at stage 3")
    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "2", "--gpu", "0"]) == 0
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 0
    assert "pushed revision" in capsys.readouterr().out
    assert len(test_hub.commits(REPO_ID)) == 3        # the repo's initial commit, two pushes

    pulled = tmp_path / "pulled"
    assert cli_main(["--pod-dir", str(pulled), "sync", "pull", "--from",
                     f"hf://{REPO_ID}"]) == 0
    on_hub = read_manifest(pulled / config.manifest)
    here = read_manifest(pod / config.manifest)
    assert on_hub.recorded_stages() == [2]
    assert {g: e.start_token for g, e in on_hub.entries.items()} == \
        {g: e.start_token for g, e in here.entries.items()} == {0: 100, 1: 200}


# ---- end to end: the real launcher, workers and launch --from-hub --------------------------
def test_a_rollback_by_hand_then_a_push_rebuilds_the_pod_at_the_rolled_back_stage_and_tokens(
        tmp_path, launchers, capsys):
    pod = make_pod(tmp_path, criteria=FAST_PASS, hub="file://hub", sync={"interval": 3600})
    first = Launcher(pod, "--stage", "3", "--max-steps", "6")   # checkpoints at steps 5, 6
    launchers.append(first)
    assert first.wait(120) == 0, first.output()
    (pushed,) = events_of(pod, "sync_pushed")
    assert pushed["tokens"] == {"0": 6 * TOKENS_PER_STEP, "1": 6 * TOKENS_PER_STEP}

    # A verdict after the push (e.g. the AR probe) failed GPU 0's newest checkpoint; the
    # user rolls the pod back to stage 2, GPU 0 to its newest passed checkpoint (step 5).
    index = CheckpointIndex(pod)
    newest = index.for_gpu(0)[-1]
    assert newest["next_token"] == 6 * TOKENS_PER_STEP and newest["verdict"] == PASSED
    index.mark(0, newest["sha256"], FAILED, "AR probe failed after the push")
    assert cli_main(["--pod-dir", str(pod), "rollback", "--to-stage", "2", "--gpu", "0"]) == 0
    assert cli_main(["--pod-dir", str(pod), "sync", "push"]) == 0
    assert "pushed revision" in capsys.readouterr().out
    rolled_back = manifest_json(pod)
    tokens = {g: rolled_back[f"gpu_{g}"]["start_token"] for g in (0, 1)}
    assert tokens == {0: 5 * TOKENS_PER_STEP, 1: 6 * TOKENS_PER_STEP}

    rebuilt = tmp_path / "rebuilt"
    done = launch_from_hub(rebuilt, f"file://{pod / 'hub'}", "--max-steps", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    (launch,) = events_of(rebuilt, "launch")
    assert launch["stage"] == 2
    for gpu in (0, 1):
        assert worker_records(rebuilt, gpu, "start")[0]["next_token"] == tokens[gpu]
