"""The user docs (README.md, docs/*.md) state what the code does: no tracker or CI-stop
numbers, and docs/FIRST_POD.md's glossary names every column, GPU state and verdict that
`fractus-pod status` shows, and the settings `init --preset 1b-8gpu` leaves to the user."""

from __future__ import annotations

import re
from pathlib import Path

from launcher.checks.health import FAILED, INCONCLUSIVE, PENDING, RUNNING, SUCCESSFUL
from launcher.config.podconfig import PRESETS
from launcher.dashboard.status_table import COLUMNS
from launcher.supervise.state import GpuState

REPO = Path(__file__).resolve().parents[1]
USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FIRST_POD = REPO / "docs" / "FIRST_POD.md"


def test_user_docs_name_no_issue_or_ci_stop_numbers():
    pattern = re.compile(r"\bissue #?\d+|\bstop \d+\b", re.I)      # "CI stop 23", "stop 23's"
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()[:80]}"
             for path in USER_DOCS
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert found == []


def test_the_first_pod_page_is_linked_and_its_glossary_names_what_status_shows():
    assert "docs/FIRST_POD.md" in (REPO / "README.md").read_text()
    text = FIRST_POD.read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", text, re.M))
    assert {c.header for c in COLUMNS} <= rows, {c.header for c in COLUMNS} - rows
    for state in GpuState:
        assert f"`{state.value}`" in text, state
    for verdict in (PENDING, RUNNING, SUCCESSFUL, FAILED, INCONCLUSIVE, "Incomplete"):
        assert f"`{verdict}`" in text, verdict
    for term in ("`AR`", "`ARacc`", "`ema_tf`", "`ema_ss`", "`lb`"):
        assert term in text


def test_the_first_pod_page_states_what_the_1b_preset_leaves_to_the_user():
    text = FIRST_POD.read_text()
    preset = PRESETS["1b-8gpu"]
    assert preset.hub is None and "**`hub: null`**" in text
    assert "ALLOW_FRESH_START" not in preset.env and 'ALLOW_FRESH_START: "1"' in text
    assert "init --preset 1b-8gpu" in text and "launch --stage 1 --detach" in text
    assert "hf auth login" in text and "HF_TOKEN" in text and "private" in text
