"""A clone of this repository alone passes its tests: nothing the tests read lies outside it."""

import hashlib
import re
from pathlib import Path

from tests.conftest import LEGACY_FIXTURES, REPO_ROOT


def test_reference_fixtures_live_inside_the_repository():
    assert LEGACY_FIXTURES.resolve().is_relative_to(REPO_ROOT.resolve())
    recorded = dict(re.findall(r"^([0-9a-f]{64})\s+(\S+\.pt)$",
                               (LEGACY_FIXTURES / "README.md").read_text(), re.M))
    assert sorted(recorded.values()) == ["lowrank_dense.pt", "lowrank_sparse.pt", "three_levels.pt"]
    for digest, name in recorded.items():
        assert hashlib.sha256((LEGACY_FIXTURES / name).read_bytes()).hexdigest() == digest, name


def test_no_test_reaches_outside_the_repository():
    outside = re.compile(r"""\.\./shared|parent\s*/\s*["']shared["']""")
    offenders = [p.name for p in Path(REPO_ROOT, "tests").rglob("*.py")
                 if p.name != Path(__file__).name and outside.search(p.read_text())]
    assert offenders == []
