"""A pod refusing bad input: `pod` (a copy of one `init` per test module), `edit_config`
changes its fractus-pod.yaml, `refused` runs a command and asserts the refusal's contract
(exit 2, one `error:` line, no traceback, the pod byte for byte as it was), returning the
line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from launcher.cli import main as cli_main
from tests.support.pod_files import tree

CONFIG = "fractus-pod.yaml"


@pytest.fixture(scope="module")
def pod_template(tmp_path_factory) -> Path:
    pod = tmp_path_factory.mktemp("template") / "pod"
    assert cli_main(["--pod-dir", str(pod), "init"]) == 0
    return pod


@pytest.fixture
def pod(tmp_path, pod_template) -> Path:
    dest = tmp_path / "pod"
    shutil.copytree(pod_template, dest)
    return dest


def edit_config(pod: Path, **changes) -> None:
    data = yaml.safe_load((pod / CONFIG).read_text())
    data.update(changes)
    (pod / CONFIG).write_text(yaml.safe_dump(data))


def refused(pod: Path, capsys, *args: str) -> str:
    """Run `launch` (or the given command): exit 2, one `error:` line, the pod unchanged."""
    before = tree(pod)
    # --max-time bounds a launch the refusal failed to stop (the old code started the pod).
    code = cli_main(["--pod-dir", str(pod), *(args or ("launch", "--stage", "1",
                                                       "--max-time", "5"))])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err + captured.out
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert len(lines[0]) < 600, lines[0][:200]
    assert "Traceback" not in captured.out + captured.err
    assert tree(pod) == before, "the refusal changed the pod"
    return lines[0]
