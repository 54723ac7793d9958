"""Shards from a dataset store (`data:` of the pod config): `data push` records them once,
`ensure_shards` (launcher/hub/fetch.py) puts verified bytes in place, resumes a cut
download from its .partial file and never installs bytes that differ from the record.
Real huggingface_hub client against the test hub (tests/support/hub_server.py)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from launcher.cli import main as cli_main
from launcher.config.data_settings import DataSource
from launcher.errors import UserError
from launcher.hub import HubError, IntegrityError, RetryPolicy
from launcher.hub.data_source import push_shards
from launcher.hub.fetch import ensure_shards
from tests.support.hub_server import TEST_TOKEN, test_hub  # noqa: F401  (pytest fixture)

DATASET = "fractus/shards"
URL = f"hf://datasets/{DATASET}"
SHARDS = ["data/shard_phase2_gpu0.npy", "data/shard_phase2_gpu1.npy"]
SIZE = 3 << 20            # sent through LFS (.npy)
# The client writes a download in chunks of 10 MiB: gpu0's shard is large enough that half
# of it (where the test hub cuts the connection) holds a whole chunk.
SIZES = (24 << 20, SIZE)
ONCE = RetryPolicy(attempts=1)
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture(autouse=True)
def _quiet_client(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def shard_bytes(gpu: int) -> bytes:
    return hashlib.sha256(b"seed%d" % gpu).digest() * (SIZES[gpu] // 32)


def source_pod(root: Path) -> Path:
    pod = root / "source"
    for gpu, rel in enumerate(SHARDS):
        (pod / rel).parent.mkdir(parents=True, exist_ok=True)
        (pod / rel).write_bytes(shard_bytes(gpu))
    return pod


def pushed(test_hub, tmp_path) -> DataSource:
    source, uploaded = push_shards(source_pod(tmp_path), SHARDS, URL, ONCE)
    assert uploaded == SHARDS
    return source


def shard_gets(test_hub) -> list:
    return [r for r in test_hub.routed("resolve", "GET") if "shard_phase2" in r.path]


def test_fetch_puts_the_recorded_bytes_in_place_and_a_stamped_shard_is_not_read_again(
        test_hub, tmp_path):
    source = pushed(test_hub, tmp_path)
    pod = tmp_path / "pod"
    assert ensure_shards(SHARDS, source, pod, ONCE) == SHARDS
    for gpu, rel in enumerate(SHARDS):
        assert (pod / rel).read_bytes() == shard_bytes(gpu)
        assert not (pod / (rel + ".partial")).exists()
    stamps = json.loads((pod / "logs" / "data_verified.json").read_text())
    assert stamps["revision"] == source.revision and set(stamps["files"]) == set(SHARDS)
    assert all(r.authenticated for r in shard_gets(test_hub))

    # Stamped and unchanged: no request at all (a pod launches without its store).
    before = len(test_hub.requests)
    assert ensure_shards(SHARDS, source, pod, ONCE) == []
    assert len(test_hub.requests) == before

    # A shard rewritten since its stamp is hashed again, and other bytes are refused
    # (never trained on, and left as they are: they may be the user's).
    (pod / SHARDS[1]).write_bytes(b"x" * SIZE)
    with pytest.raises(UserError, match="holds other bytes than revision"):
        ensure_shards(SHARDS, source, pod, ONCE)
    assert (pod / SHARDS[1]).read_bytes() == b"x" * SIZE


def test_a_download_cut_mid_way_resumes_from_the_partial_file(test_hub, tmp_path):
    source = pushed(test_hub, tmp_path)
    pod = tmp_path / "pod"
    # The connection drops after half the bytes; the client's own resume then meets a
    # server error: this process gives up with the half kept.
    test_hub.faults.add("resolve", "truncate", method="GET", path_contains="gpu0")
    test_hub.faults.add("resolve", "status", status=500, count=10, method="GET",
                        path_contains="gpu0")
    with pytest.raises(HubError, match="rerun to resume"):
        ensure_shards(SHARDS[:1], source, pod, ONCE)
    partial = pod / (SHARDS[0] + ".partial")
    held = partial.stat().st_size
    assert 0 < held <= SIZES[0] // 2
    assert not (pod / SHARDS[0]).exists()

    test_hub.faults.clear()
    gets = len(shard_gets(test_hub))
    assert ensure_shards(SHARDS[:1], source, pod, ONCE) == SHARDS[:1]   # a new call: a rerun
    (resumed,) = shard_gets(test_hub)[gets:]
    assert resumed.range == f"bytes={held}-"          # only the missing part was asked for
    assert (pod / SHARDS[0]).read_bytes() == shard_bytes(0)
    assert not partial.exists()


def test_bytes_the_hub_corrupts_are_fetched_again_then_refused_never_installed(
        test_hub, tmp_path):
    source = pushed(test_hub, tmp_path)
    pod = tmp_path / "pod"
    test_hub.faults.add("resolve", "corrupt", method="GET", path_contains="gpu0")
    assert ensure_shards(SHARDS[:1], source, pod, ONCE) == SHARDS[:1]
    assert len(shard_gets(test_hub)) == 2
    assert (pod / SHARDS[0]).read_bytes() == shard_bytes(0)

    test_hub.faults.add("resolve", "corrupt", count=2, method="GET", path_contains="gpu1")
    with pytest.raises(IntegrityError, match="other bytes than recorded; refused"):
        ensure_shards(SHARDS, source, pod, ONCE)
    assert not (pod / SHARDS[1]).exists()
    assert not (pod / (SHARDS[1] + ".partial")).exists()


def test_data_push_uploads_once_and_records_the_revision_in_the_pod_config(
        test_hub, tmp_path, capsys):
    pod = source_pod(tmp_path)
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    config = pod / "fractus-pod.yaml"
    assert cli_main(["--pod-dir", str(pod), "data", "push", "--to", URL]) == 0
    assert "2 shard(s) uploaded, 0 already there" in capsys.readouterr().out
    commits = test_hub.commits(DATASET, "dataset")
    from launcher.config.podconfig import load_pod_config
    recorded = load_pod_config(pod).data
    assert recorded == DataSource(URL, commits[0].oid)

    # Rerun: every shard is there by sha256: nothing uploaded, no new revision.
    uploads = len(test_hub.routed("lfs_upload"))
    assert cli_main(["--pod-dir", str(pod), "data", "push", "--to", URL]) == 0
    assert "0 shard(s) uploaded, 2 already there" in capsys.readouterr().out
    assert len(test_hub.commits(DATASET, "dataset")) == len(commits)
    assert len(test_hub.routed("lfs_upload")) == uploads
    assert load_pod_config(pod).data == recorded
    assert TEST_TOKEN not in config.read_text()


def test_a_file_store_serves_the_same_way(tmp_path):
    store = tmp_path / "store"
    source, _ = push_shards(source_pod(tmp_path), SHARDS, f"file://{store}", ONCE)
    assert len(source.revision) == 64
    pod = tmp_path / "pod"
    assert ensure_shards(SHARDS, source, pod, ONCE) == SHARDS
    assert [(pod / r).read_bytes() for r in SHARDS] == [shard_bytes(0), shard_bytes(1)]
    os.utime(pod / SHARDS[0], ns=(0, 0))        # touched: verified again, from disk
    assert ensure_shards(SHARDS, source, pod, ONCE) == []


def _pod_with_data(tmp_path: Path, data: dict) -> Path:
    import yaml
    pod = tmp_path / "pod"
    assert cli_main(["--pod-dir", str(pod), "init", "--preset", "tiny-cpu", "--no-data"]) == 0
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config.update(data=data, sync={"interval": 3600, "attempts": 1})
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    return pod


def _files(root: Path) -> dict[str, bytes | None]:
    """Every path under `root`, a file with its bytes (a new empty directory counts too)."""
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
            for p in root.rglob("*")}


@pytest.mark.parametrize("data, named", [
    ({"url": "hf://datasets/only-owner", "revision": "a" * 40}, "hf://datasets/only-owner"),
    ({"url": "s3://bucket/shards", "revision": "a" * 40}, "s3://bucket/shards"),
    ({"url": URL, "revision": "main"}, "'main'"),
    ({"url": URL, "revision": "a" * 64}, "a" * 64),
    ({"url": URL, "revision": "a" * 40, "token": "x"}, "token"),
])
def test_a_malformed_data_source_is_refused_in_one_line_with_nothing_written(
        tmp_path, capsys, data, named):
    pod = _pod_with_data(tmp_path, data)
    before = _files(pod)
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "launch", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and named in err, err
    assert _files(pod) == before


def test_an_unreachable_data_store_refuses_the_launch_in_one_line_with_nothing_written(
        test_hub, tmp_path, capsys, monkeypatch):
    source = pushed(test_hub, tmp_path)
    for case, (url, revision, endpoint) in enumerate([
            (URL, source.revision, "http://127.0.0.1:9"),          # nothing listens there
            (URL, "f" * 40, test_hub.url),                          # no such revision
            (f"file://{tmp_path / 'no_store'}", "f" * 64, test_hub.url)]):
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        pod = _pod_with_data(tmp_path / f"case{case}",
                             {"url": url, "revision": revision})
        before = _files(pod)
        capsys.readouterr()
        assert cli_main(["--pod-dir", str(pod), "launch", "--max-steps", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert err.startswith("error: data: cannot read revision") and url in err, err
        assert _files(pod) == before


def test_a_launch_whose_hub_serves_other_bytes_is_refused_before_any_worker(
        test_hub, tmp_path, capsys):
    source = pushed(test_hub, tmp_path)
    pod = _pod_with_data(tmp_path / "launch", source.to_dict())
    test_hub.faults.add("resolve", "corrupt", count=2, method="GET", path_contains="gpu0")
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "launch", "--max-steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "other bytes than recorded; refused" in err.strip().splitlines()[-1]
    assert not (pod / SHARDS[0]).exists()
    assert not (pod / "logs" / "metrics_gpu0.jsonl").exists()      # no worker started


def test_a_phase_the_data_store_does_not_record_refuses_the_launch_with_nothing_written(
        tmp_path, capsys):
    """A later phase's shards missing from the store: refused at launch, before any shard
    is fetched, not when phase 1 ends hours into the run."""
    import yaml
    source, _ = push_shards(source_pod(tmp_path), SHARDS, f"file://{tmp_path / 'store'}", ONCE)
    pod = _pod_with_data(tmp_path, source.to_dict())
    config = yaml.safe_load((pod / "fractus-pod.yaml").read_text())
    config["shards"] = ["data/shard_phase2_gpu{i}.npy", "data/later_gpu{i}.npy"]
    (pod / "fractus-pod.yaml").write_text(yaml.safe_dump(config))
    before = _files(pod)
    capsys.readouterr()
    assert cli_main(["--pod-dir", str(pod), "launch", "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "records no data/later_gpu0.npy, data/later_gpu1.npy; put the shards there with " \
           "`fractus-pod data push" in err, err
    assert _files(pod) == before
