"""A GPU's newest checkpoint damaged where no copy of its bytes is left (written in place:
its retained link shares the inode; not passed, so not on the hub) does not stop the pod:
the GPU goes back to its newest passed checkpoint left intact by itself, at its stage, as a
`rollback` event, which alerts. Only a GPU with no passed checkpoint left stops it.

On the fake backend (no processes, a fake clock: tests/support/fake_supervisor.py); the
same at launch, with real workers: tests/test_launcher_recovery.py.
"""

from launcher.alerts.rules import AlertRules
from launcher.config.alerts import AlertSettings
from launcher.pod.ckpt_index import FAILED
from launcher.pod.manifest import read_manifest
from launcher.supervise.state import PodState
from tests.support.fake_supervisor import (  # noqa: F401 (fixtures)
    events,
    make,
    passed_checkpoint,
    pod_template,
)


def damage_in_place(path) -> None:
    with open(path, "r+b") as f:
        f.write(b"\0\0\0\0")


def crash_and_restart(sup, backend, clock, gpu: int) -> None:
    backend.exit(gpu, 1)
    sup.step()
    clock.now += 120
    sup.step()


def test_a_damaged_newest_checkpoint_mid_run_goes_back_to_the_newest_passed_one(make):
    """Seen: the pod stopped FAILED with a 451-character line naming the passed copy and the
    `rollback --gpu` command that would restore it; a damaged copy with a retained twin was
    recovered by itself meanwhile. Now the passed copy is restored by itself too."""
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    good = passed_checkpoint(sup, backend, 0)
    backend.train(0, 10)
    newest = backend.checkpoint(0)
    sup.step()
    pod_dir, entry = sup.pod.pod_dir, sup.pod.manifest.entries[0]
    assert entry.checkpoint_sha256 == newest["sha256"]
    damage_in_place(pod_dir / entry.checkpoint)
    crash_and_restart(sup, backend, clock, 0)

    assert sup.pod.state is PodState.RUNNING and not events(sup, "pod_failed")
    (rolled,) = events(sup, "rollback", gpu=0)
    assert (rolled["from_token"], rolled["to_token"]) == (newest["next_token"],
                                                          good["next_token"])
    assert rolled["from_stage"] == rolled["to_stage"] == 3 and rolled["automatic"]
    assert rolled["lost"] == "checkpoints/fractus_1b_gpu0.pt"
    restarted = backend.current(0)
    assert restarted.spec.start_token == good["next_token"]
    assert restarted.spec.ckpt_sha256 == good["sha256"] and restarted.spec.stage == 3
    assert sup.pod.custodian.index.records[(0, newest["sha256"])]["verdict"] == FAILED
    # Written: the next launch, and the user's own relaunch, resume there too.
    written = read_manifest(pod_dir / sup.pod.plan.config.manifest).entries[0]
    assert (written.start_token, written.checkpoint_sha256) == (good["next_token"],
                                                                good["sha256"])
    # The event is an alert (the router mirrors the event log): a warning naming the GPU.
    alert = AlertRules(AlertSettings()).alert_for(rolled)
    assert alert.severity == "warning" and "GPU 0 rolled back" in alert.title
    assert "no local copy or hub revision holds those bytes" in alert.title


def test_a_damaged_checkpoint_with_no_passed_one_left_still_stops_the_pod(make):
    sup, backend, clock = make(stage=3)
    sup.starter.start_all()
    backend.train(0, 10)
    backend.checkpoint(0)
    sup.step()
    damage_in_place(sup.pod.pod_dir / sup.pod.manifest.entries[0].checkpoint)
    crash_and_restart(sup, backend, clock, 0)
    assert sup.pod.state is PodState.FAILED and sup.pod.exit_code == 1
    (failed,) = events(sup, "pod_failed")
    assert "no passed checkpoint of it is left intact either" in failed["reason"]
    assert not events(sup, "rollback")
