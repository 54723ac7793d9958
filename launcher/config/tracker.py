"""`tracker:` of the pod config: the GPUs' metrics mirrored to trackio (docs/LAUNCHER.md,
Metrics in trackio). Off without the key; the store stays inside the pod, so the config names
no path, command or token.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

from launcher.errors import UserError, install_hint, optional_section

KINDS = ("trackio",)
_PROJECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


@dataclass(frozen=True)
class TrackerSettings:
    kind: str
    project: str

    KEYS = ("kind", "project")

    @classmethod
    def parse(cls, data: dict | None, source: str = "tracker") -> "TrackerSettings | None":
        """None when the config has no `tracker:` (nothing is mirrored)."""
        data = optional_section(data, cls.KEYS, source, "like {kind: trackio, project: NAME}")
        if data is None:
            return None
        kind, project = data.get("kind"), data.get("project")
        if kind not in KINDS:
            raise UserError(f"{source}.kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(project, str) or not _PROJECT.fullmatch(project):
            raise UserError(f"{source}.project must be a name of 1 to 96 letters, digits, "
                            f"'.', '_' or '-' (e.g. fractus-1b), got {project!r}")
        return cls(kind, project)


def check_installed(settings: "TrackerSettings | None") -> None:
    """Refuse a launch with `tracker:` early when its package is missing."""
    if settings is not None and importlib.util.find_spec(settings.kind) is None:
        raise UserError(f"tracker: kind {settings.kind} needs the {settings.kind} package: "
                        f"{install_hint('tracker')}, or remove tracker: from "
                        f"fractus-pod.yaml")
