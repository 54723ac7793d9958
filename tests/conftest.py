"""Shared test fixtures. Module-specific helpers live in tests/support/."""

import signal
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


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """Tests that run the worker's main() in-process install its SIGTERM/SIGINT handlers in
    pytest's process; they must end with the test. Left behind, a later Ctrl-C or a CI
    timeout's SIGTERM raised the worker's StoppedBeforeProgress inside an unrelated test."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
