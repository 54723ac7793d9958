"""The launch's order lives in one list (launcher/cli/launch_steps.py PREPARE), of named
steps; docs/LAUNCHER.md names the same steps in the same order."""

import re
from pathlib import Path

from launcher.cli.launch_steps import PREPARE

DOC = Path(__file__).resolve().parents[1] / "docs" / "LAUNCHER.md"


def test_the_docs_name_the_launch_steps_in_their_order():
    text = " ".join(DOC.read_text().split())
    listed = re.search(r"then `PREPARE`: (.*?) \(their bodies", text)
    assert listed, "docs/LAUNCHER.md no longer lists PREPARE's steps"
    assert re.findall(r"`(\w+)`", listed.group(1)) == [step.__name__ for step in PREPARE]
