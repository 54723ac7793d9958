"""Reading the pod's YAML files, with a user mistake reported as one line."""

from __future__ import annotations

from pathlib import Path

import yaml

from launcher.errors import UserError


def read_yaml(path: str | Path, what: str):
    """The parsed document (None for an empty file); UserError if missing or not YAML."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: invalid YAML ({str(exc).splitlines()[0]})") from None
