"""The real HfApi client against the test hub (tests/support/hub_server.py): the repository
the tests sync to, a quiet client, and the check that the token leaked nowhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hub_server import TEST_TOKEN

REPO_ID = "fractus/pod-sync"


@pytest.fixture(autouse=True)
def quiet_hf_client(monkeypatch, tmp_path):
    """No progress bars in the launcher's output, no login cache outside tmp_path (autouse
    in every module that imports it)."""
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))


def assert_no_token(*roots: Path, texts: tuple[str, ...] = ()) -> None:
    """The token appears in no file under the pod (logs, events, manifests, checkpoints,
    scratch) and in no output."""
    needle = TEST_TOKEN.encode()
    for root in roots:
        files = [p for p in root.rglob("*") if p.is_file()]
        assert files
        for path in files:
            assert needle not in path.read_bytes(), f"token found in {path}"
    for text in texts:
        assert TEST_TOKEN not in text
