"""The defaults of the criteria file are the shipped trusted_loss.yaml (package data,
launcher/config/defaults/, the file `init` copies into a pod's manifests/), and only it.

A key a pod's criteria file leaves out takes the shipped file's value: the code that types
each section (criteria.py, canary_settings.py, probe_check.py) has no defaults of its own,
so deleting a key can never silently change a check to a value nobody documented.
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
    """`data` (a parsed criteria file) over the shipped file: every key missing from a
    mapping the two share is taken from the shipped file; what the user wrote wins, an
    explicit null for a value included (a null section means the whole shipped section).
    Anything but a mapping is returned as it is, for the section parsers to refuse."""
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
