"""Shared test fixtures. Module-specific helpers live in tests/support/."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# The reference outputs travel with the repository (provenance: tests/fixtures/legacy/README.md),
# so a clone alone passes its tests.
LEGACY_FIXTURES = REPO_ROOT / "tests" / "fixtures" / "legacy"


@pytest.fixture(scope="session")
def legacy_fixture_dir() -> Path:
    if not LEGACY_FIXTURES.is_dir():
        pytest.fail(f"reference fixtures not found at {LEGACY_FIXTURES}")
    return LEGACY_FIXTURES
