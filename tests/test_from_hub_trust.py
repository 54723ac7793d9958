"""`launch --from-hub` takes nothing executable from the hub without the local user's
`--trust-hub-config` (issue 16 item 15): a hub whose fractus-pod.yaml sets a worker command
and an env entry naming a file outside the pod is refused with one line naming them, the new directory is left empty and
the hub's command never runs; with the flag the user takes them as they are.

Real processes: the CLI as a child process, a file:// hub store pushed by a real pod.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.config.podconfig import PodConfig
from launcher.config.stages import Stage
from launcher.hub import open_store
from launcher.hub.config_trust import untrusted_config, untrusted_stages
from tests.support.e2e import REPO, events_of, make_pod
from tests.support.from_hub import fractus_pod
from tests.support.hub_pod import FAST_PASS

HOSTILE_WORKER = ["/bin/sh", "-c", "echo ran > MARKER; exit 2"]


@pytest.fixture
def hostile_hub(tmp_path) -> str:
    """A file:// hub of a real run whose newest revision's pod config, committed by whoever
    can write the hub, runs a command and points a worker setting outside the pod."""
    old = make_pod(tmp_path / "a", criteria=FAST_PASS)          # hub: file://hub (in the pod)
    done = fractus_pod(old, "launch", "--stage", "1", "--gpus", "0", "--max-steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load((old / "fractus-pod.yaml").read_text())
    config["worker"] = HOSTILE_WORKER
    config["env"]["CKPT_IN"] = str(tmp_path / "elsewhere.pt")
    (old / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    url = f"file://{old / 'hub'}"
    open_store(url, old).push({"fractus-pod.yaml": old / "fractus-pod.yaml"}, "a new worker")
    return url


def test_a_hub_config_that_would_run_code_is_refused_unless_trusted(hostile_hub, tmp_path):
    new = tmp_path / "new" / "pod"
    done = fractus_pod(new, "launch", "--from-hub", hostile_hub, "--gpus", "0",
                       "--max-steps", "1")
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()                 # one line, no traceback
    assert line.startswith("error: --from-hub: ")
    assert "worker: ['/bin/sh', '-c'" in line and "env: CKPT_IN outside the pod" in line
    assert "--trust-hub-config" in line
    assert not new.exists() or not any(new.iterdir())          # nothing taken, nothing ran
    assert not (REPO / "MARKER").exists()

    # The user says so: the hub's command is theirs to run (the positive control).
    done = fractus_pod(new, "launch", "--from-hub", hostile_hub, "--gpus", "0",
                       "--max-steps", "1", "--trust-hub-config")
    assert (new / "MARKER").is_file(), done.stdout + done.stderr
    assert (new / "MARKER").read_text() == "ran\n"
    assert events_of(new, "rebuilt_from_hub")


@pytest.mark.parametrize("command, source_flag", [(("launch",), "--from-hub"),
                                                   (("sync", "pull"), "--from")])
def test_trust_hub_config_goes_with_the_flag_naming_a_hub(tmp_path, command, source_flag):
    done = fractus_pod(tmp_path / "pod", *command, "--trust-hub-config")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"error: --trust-hub-config goes with {source_flag} (")
    assert not (tmp_path / "pod").exists() or not any((tmp_path / "pod").iterdir())
    help_text = fractus_pod(tmp_path, *command, "--help").stdout
    assert f"With {source_flag}: take the hub config's worker command" in " ".join(help_text.split())


def test_paths_outside_the_pod_and_passed_env_are_named(tmp_path):
    pod = tmp_path / "pod"
    pod.mkdir()
    assert untrusted_config(PodConfig(env={"SEQ": "32", "BATCH": "2"}), pod) == []
    hostile = PodConfig(manifest="../elsewhere/manifest.json",
                        checkpoints="/home/someone/ckpt_{i}.pt", stages="manifests/s.yaml",
                        model="../model.json", env={"CKPT_IN": "/etc/x.pt"},
                        pass_env=["AWS_SESSION_TOKEN"])
    found = untrusted_config(hostile, pod)
    assert found == ["env: CKPT_IN outside the pod",
                     "pass_env: AWS_SESSION_TOKEN",
                     "manifest: ../elsewhere/manifest.json outside the pod",
                     "checkpoints: /home/someone/ckpt_0.pt outside the pod",
                     "model: ../model.json outside the pod"]
    # Shards may live outside the pod (a shared data directory, read only) unless the
    # config would synthesise them there.
    shared = PodConfig(shards="/data/shard_{i}.npy")
    assert untrusted_config(shared, pod) == []
    assert untrusted_config(PodConfig(shards="/data/shard_{i}.npy", demo_data={"tokens": 1}),
                            pod) == ["shards: /data/shard_0.npy outside the pod"]
    stages = {1: Stage(1, "one", False, 0, {"BATCH": "2"}),
              2: Stage(2, "two", False, 0, {"CKPT_OUT": "../../x.pt", "MODEL": "tiny"})}
    assert untrusted_stages(stages, pod) == ["stage 2 settings: CKPT_OUT outside the pod"]
    # Alerts name variables of this machine's environment the launcher would post to.
    alerting = PodConfig(alerts={"webhooks": [{"format": "generic", "url_env": "AWS_URL"}]})
    assert untrusted_config(alerting, pod) == [
        "alerts: (webhooks read from this machine's environment)"]


def test_sync_pull_from_a_hub_filters_its_config_as_launch_from_hub_does(tmp_path):
    """`sync pull --from URL` took the hub's fractus-pod.yaml as it was (the gap left by item
    15): a config naming a worker command and a Ray cluster of the hub's choosing is refused
    in one line, nothing pulled, into a new folder or over an existing pod; the user's
    --trust-hub-config takes it."""
    source = make_pod(tmp_path / "a")
    config = yaml.safe_load((source / "fractus-pod.yaml").read_text())
    config.update(worker=HOSTILE_WORKER, ray={"address": "10.9.9.9:6379"})
    (source / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    url = f"file://{tmp_path / 'hub'}"
    open_store(url, source).push({"fractus-pod.yaml": source / "fractus-pod.yaml",
                                  "manifests/stages.yaml": source / "manifests/stages.yaml"},
                                 "a hostile config")
    new = tmp_path / "new" / "pod"
    existing = make_pod(tmp_path / "b")
    before = {p: p.read_bytes() for p in sorted(existing.rglob("*")) if p.is_file()}
    for pod in (new, existing):
        done = fractus_pod(pod, "sync", "pull", "--from", url)
        assert done.returncode == 2, done.stdout + done.stderr
        (line,) = done.stderr.strip().splitlines()              # one line, no traceback
        assert line.startswith("error: sync pull --from: ")
        assert "worker: ['/bin/sh', '-c'" in line and "ray.address: 10.9.9.9:6379" in line
        assert "nothing was pulled" in line and "--trust-hub-config" in line
    assert not new.exists()
    assert {p: p.read_bytes() for p in sorted(existing.rglob("*")) if p.is_file()} == before

    done = fractus_pod(new, "sync", "pull", "--from", url, "--trust-hub-config")
    assert done.returncode == 0, done.stdout + done.stderr
    assert yaml.safe_load((new / "fractus-pod.yaml").read_text())["worker"] == HOSTILE_WORKER


def test_a_hub_configs_ray_section_names_no_cluster_or_directory_of_its_own(tmp_path):
    pod = tmp_path / "pod"
    pod.mkdir()
    assert untrusted_config(PodConfig(ray={"resource": "fractus_gpu", "fence_s": 30}), pod) == []
    named = PodConfig(ray={"address": "10.9.9.9:6379", "workdir": "/srv/{node}"})
    assert untrusted_config(named, pod) == [
        "ray.address: 10.9.9.9:6379 (a cluster the hub names; give yours with --ray ADDRESS)",
        "ray.workdir: /srv/{node} outside {pod}"]
    # launch --from-hub --ray ADDRESS: the user's cluster replaces the hub's.
    assert untrusted_config(PodConfig(ray={"address": "10.9.9.9:6379"}), pod,
                            ray_address="127.0.0.1:6379") == []
    assert untrusted_config(PodConfig(ray={"address": "a:1", "workdir": "{pod}/../{node}"}),
                            pod, ray_address="a:1") == ["ray.workdir: {pod}/../{node} outside {pod}"]
