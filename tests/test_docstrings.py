"""The product's docstrings and comments say what holds, not the history that led there:
no tracker issue or CI stop numbers in launcher/ or fractus/ (they belong in commit
messages and test names)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"\bissues? #?\d+|\bstop \d+\b", re.I)


def test_product_code_names_no_issue_or_ci_stop_numbers():
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()[:80]}"
             for package in ("launcher", "fractus")
             for path in sorted((REPO / package).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert found == []
