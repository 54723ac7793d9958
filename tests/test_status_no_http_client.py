"""`status` only reads files: it imports no HTTP client (httpx, huggingface_hub) for a pod
whose hub is a local store or the Hugging Face Hub alike (the hub package loads its
backends at first use)."""

from __future__ import annotations

import pytest

from launcher.config.yamlfile import set_top_level_key
from tests.support.dashboard import copy_recorded_pod, status_in_process

CLIENTS = ("httpx", "httpx2", "huggingface_hub")


@pytest.mark.parametrize("hub", ["file://hub", "hf://someone/run"])
def test_status_imports_no_http_client(tmp_path, hub):
    pod = copy_recorded_pod(tmp_path / "pod")
    config = pod / "fractus-pod.yaml"
    config.write_text(set_top_level_key(config.read_text(), "hub", hub, str(config)))
    code, report, loaded = status_in_process(pod, CLIENTS)
    assert (code, loaded) == (0, [])
    assert report["sync"]["hub"] == hub
