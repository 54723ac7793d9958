"""A pod config pulled from a store (`launch --from-hub`, `sync pull --from`) keeps the hub
copy's comments and key order: only its `hub:` is set to the store it came from, under one
provenance line that a later pull replaces."""

from __future__ import annotations

from launcher.config.yamlfile import parse_yaml
from launcher.hub.from_hub import keep_hub
from launcher.paths import CONFIG_NAME

HUB_COPY = ("# fractus-pod config (preset tiny-cpu). Paths are relative to this directory.\n"
            "model: tiny\n"
            "# where the run's checkpoints go: a relative store is next to this file\n"
            "hub: file://hub\n"
            "devices: cpu:2   # two workers\n"
            "sync:\n"
            "  interval: 600  # seconds between pushes\n")


def test_keep_hub_sets_only_the_hub_and_keeps_the_comments(tmp_path):
    config = tmp_path / CONFIG_NAME
    config.write_text(HUB_COPY)
    keep_hub(tmp_path, "hf://me/run", "rebuilt from hf://me/run at revision abc123")
    text = config.read_text()
    assert text == ("# rebuilt from hf://me/run at revision abc123\n"
                    + HUB_COPY.replace("hub: file://hub\n", "hub: hf://me/run\n"))
    assert parse_yaml(text, "t")["hub"] == "hf://me/run"

    # pulled again from another store: one provenance line, the newest
    keep_hub(tmp_path, "file:///stores/run", "pulled from file:///stores/run at revision def")
    lines = config.read_text().splitlines()
    assert lines[0] == "# pulled from file:///stores/run at revision def"
    assert lines[1] == HUB_COPY.splitlines()[0]
    assert "hub: file:///stores/run" in lines and "# two workers" in config.read_text()
