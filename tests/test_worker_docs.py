"""docs/WORKER.md's tables say what the code does: each is checked against its one home."""

import dataclasses
import re
from pathlib import Path

from fractus.train.env import WorkerSettings, env_table
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


def test_the_environment_table_is_the_settings_table():
    """The table is env_table()'s output (WorkerSettings' fields, defaults and docs): no
    variable, default or meaning kept by hand."""
    assert env_table() in section("Environment"), \
        'regenerate: python -c "from fractus.train.env import env_table as t; print(t())"'


def test_a_default_shown_in_words_is_the_code_default():
    for f in dataclasses.fields(WorkerSettings):
        shown, name = f.metadata["shown"], f.metadata["env"]
        if shown is not None and f.default is not None:
            assert f.metadata["parse"](name, shown) == f.default, name
