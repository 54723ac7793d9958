"""The manifest a hub revision holds, read as `launch --from-hub` reads it (pulled, verified,
into a folder of its own next to the pod, never over the pod's own manifest)."""

from __future__ import annotations

from pathlib import Path

from launcher.config.podconfig import load_pod_config
from launcher.hub import open_store
from launcher.pod.manifest import Manifest, read_manifest


def manifest_on_hub(pod_dir: Path, revision: str) -> Manifest:
    """The manifest of `revision` of the pod's file:// hub."""
    config = load_pod_config(pod_dir)
    url = open_store(config.hub, pod_dir).url         # absolute: a relative DIR is the pod's
    fresh = pod_dir.parent / f"on-hub-{revision[:12]}"
    open_store(url, fresh).pull([config.manifest], revision)
    return read_manifest(fresh / config.manifest)
