"""docs/WORKER.md's tables say what the code does: each is checked against its one home."""

import re
from pathlib import Path

from fractus.train.exit_codes import WorkerExitCode

WORKER_MD = Path(__file__).resolve().parents[1] / "docs" / "WORKER.md"


def section(title: str) -> str:
    text = WORKER_MD.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def test_the_exit_code_table_lists_the_enum():
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", section("Exit codes and signals"), re.M)
    assert {int(code): name for code, name in rows} == \
        {code.value: code.name for code in WorkerExitCode}
