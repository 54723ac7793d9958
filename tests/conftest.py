"""Shared test fixtures. Module-specific helpers live in tests/support/.

The trained pods are made once per session (a real worker or launcher run each) and only
read: a test or module copies one (tests/support/pods.py: copy_pod) before changing it. A
session fixture imported into several modules would run once per module; defined here it
runs once."""

import signal
from pathlib import Path

import pytest

from tests.support.pods import stage1_pod

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


@pytest.fixture(scope="session")
def worker_trained_pod(tmp_path_factory) -> Path:
    """A tiny CPU pod trained 3 steps at stage 1 by the real worker. Read-only: copy it."""
    return stage1_pod(tmp_path_factory.mktemp("worker_trained") / "pod")


@pytest.fixture(scope="session")
def launcher_trained_pod(tmp_path_factory) -> Path:
    """A tiny CPU pod (tests/support/canary_pod.py's criteria) trained 3 steps at stage 1 by
    the real launcher. Read-only: copy it."""
    from tests.support.canary_pod import launched_stage1_pod
    return launched_stage1_pod(tmp_path_factory.mktemp("launcher_trained"))
