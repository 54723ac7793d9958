"""huggingface_hub's own warnings (its retries on the upload routes) land in the pod's
logs/hub.log with the store's retries, scrubbed of the token, not on the terminal."""

from __future__ import annotations

import logging
import os

from launcher.cli.options import log_hub_retries
from launcher.hub import open_store
from tests.support.hub_server import TEST_TOKEN, test_hub  # noqa: F401  (pytest fixture)
from tests.support.pod_files import write_file

REPO = "me/run"


def test_the_clients_rate_limit_warnings_during_a_push_land_in_hub_log_redacted(
        test_hub, tmp_path, capfd):
    pod = tmp_path / "pod"
    write_file(pod, "checkpoints/a.pt", os.urandom(4096))
    log_hub_retries(pod)
    try:
        store = open_store(f"hf://{REPO}", pod)
        # the LFS batch call is retried by the client itself (its http_backoff), not by ours
        test_hub.faults.add("lfs_batch", "status", count=1, status=429,
                            headers={"Retry-After": "0"})
        store.push(["checkpoints/a.pt"], "rate-limited upload")
        logging.getLogger("huggingface_hub.utils._http").warning(
            "Retrying with Authorization: Bearer %s", TEST_TOKEN)
    finally:
        launcher_hub = logging.getLogger("launcher.hub")
        for handler in [h for h in launcher_hub.handlers if getattr(h, "fractus_pod_log", 0)]:
            launcher_hub.removeHandler(handler)
            handler.close()
    logged = (pod / "logs" / "hub.log").read_text()
    assert "huggingface_hub warning: HTTP Error 429 thrown while requesting POST" in logged
    assert "huggingface_hub warning: Rate limited. Waiting" in logged
    assert "Bearer <redacted>" in logged and TEST_TOKEN not in logged
    err = capfd.readouterr().err
    assert "429" not in err and TEST_TOKEN not in err
