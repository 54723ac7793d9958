"""`launch` onto a Ray cluster that is not there refuses before it writes anything (issue 16,
item 19): one `error:` line naming the address, exit 2, and the pod byte for byte as it
was. `ray.init` to such an address retried for ever after the launcher had taken the lock
and written its state files. No cluster is started: the address is a bound port that
nobody listens on.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.e2e import REPO, make_pod


def tree(pod: Path) -> dict[str, str]:
    """Every directory and file under the pod, a file by its bytes' sha256 and its mode."""
    return {str(p.relative_to(pod)): (f"{hashlib.sha256(p.read_bytes()).hexdigest()} "
                                      f"{p.stat().st_mode:o}" if p.is_file() else "dir")
            for p in sorted(pod.rglob("*"))}


def test_an_unreachable_cluster_is_refused_before_anything_is_written(tmp_path):
    pod = make_pod(tmp_path)
    before = tree(pod)
    with socket.socket() as closed:            # bound, never listening: refused at once
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        done = subprocess.run([sys.executable, "-m", "launcher.cli", "--pod-dir", str(pod),
                               "launch", "--stage", "1", "--ray", address],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()                 # one line, no traceback
    assert line.startswith(f"error: ray: cannot reach the cluster at {address} ")
    assert "--ray HOST:PORT" in line
    assert tree(pod) == before


def test_only_a_host_port_address_is_checked_here():
    from launcher.supervise.ray.reach import gcs_endpoint
    assert gcs_endpoint("10.0.0.1:6379") == ("10.0.0.1", 6379)
    assert gcs_endpoint("[::1]:6379") == ("::1", 6379)
    # Ray resolves these itself: `auto` (the cluster started on this machine), a client URL.
    assert gcs_endpoint("auto") is None and gcs_endpoint("ray://head:10001") is None
    assert gcs_endpoint("head") is None


def test_no_hub_is_refused_on_a_ray_pod_whose_checkpoints_only_the_hub_holds(tmp_path, capsys):
    """Rebuilt from the hub onto a cluster, the pod's weights stayed on the hub, where each
    node fetches its GPU's: `--no-hub` would leave the nodes nothing to start from. Refused
    in one line naming the pull, before the cluster is reached (the address answers nobody:
    without the refusal the launch says it cannot reach it)."""
    from launcher.config.podconfig import load_pod_config
    from launcher.pod.manifest import ManifestEntry, read_manifest, write_manifest
    from tests.support.refusals import refused

    pod = make_pod(tmp_path, hub="file://hub")
    manifest = read_manifest(pod / load_pod_config(pod).manifest)
    for gpu, rev in ((0, "a" * 40), (1, "b" * 40)):
        manifest.entries[gpu] = ManifestEntry(
            start_token=640, checkpoint=f"checkpoints/fractus_1b_gpu{gpu}.pt",
            checkpoint_sha256="ab" * 32, hub_revision=rev, stage=1, ema_tf=5.0, lb=2.0)
    write_manifest(manifest)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        line = refused(pod, capsys, "launch", "--stage", "1", "--ray", address, "--no-hub")
        assert line.startswith("error: --no-hub: GPU(s) 0, 1 resume from a checkpoint only "
                               "the hub holds")
        assert line.endswith(
            f"fractus-pod --pod-dir {pod} sync pull --revision {'a' * 40} "
            f"checkpoints/fractus_1b_gpu0.pt && fractus-pod --pod-dir {pod} sync pull "
            f"--revision {'b' * 40} checkpoints/fractus_1b_gpu1.pt")
        # with the hub the nodes fetch them: the launch goes on to the cluster
        line = refused(pod, capsys, "launch", "--stage", "1", "--ray", address)
        assert line.startswith(f"error: ray: cannot reach the cluster at {address} ")
