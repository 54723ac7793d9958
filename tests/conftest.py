"""Shared test fixtures. Module-specific helpers live in tests/support/."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LEGACY_FIXTURES = REPO_ROOT.parent / "shared" / "fixtures" / "legacy"


@pytest.fixture(scope="session")
def legacy_fixture_dir() -> Path:
    if not LEGACY_FIXTURES.is_dir():
        pytest.fail(f"reference fixtures not found at {LEGACY_FIXTURES}")
    return LEGACY_FIXTURES
