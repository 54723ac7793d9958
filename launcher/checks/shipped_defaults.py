"""The only defaults of the criteria file: the shipped trusted_loss.yaml (the file `init`
copies), so deleting a key never silently changes a check to an undocumented value.
"""

from __future__ import annotations

import copy
import functools

from launcher.config.podconfig import DEFAULT_MANIFESTS
from launcher.config.yamlfile import read_yaml

SHIPPED_CRITERIA = DEFAULT_MANIFESTS / "trusted_loss.yaml"


@functools.lru_cache(maxsize=1)
def _shipped() -> dict:
    return read_yaml(SHIPPED_CRITERIA, "shipped criteria file")


def with_shipped_defaults(data):
    """`data` over the shipped file, key by key: the user's wins (a null value too; a null
    section means the shipped one). A non-mapping is returned for the parsers to refuse."""
    return _overlay(copy.deepcopy(_shipped()), data)


def _overlay(shipped, given):
    if given is None and isinstance(shipped, dict):
        return shipped          # `trend:` with nothing under it: all of the shipped section
    if not isinstance(shipped, dict) or not isinstance(given, dict):
        return given
    merged = dict(shipped)
    for key, value in given.items():
        merged[key] = _overlay(shipped[key], value) if key in shipped else value
    return merged
