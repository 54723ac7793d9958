"""Two pods writing to one hub: the store contract every backend (file://, hf://) keeps."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.hub import PushConflict
from tests.support.pod_files import MANIFEST, write_file


def second_writer_is_refused(a, pod_a: Path, b, pod_b: Path) -> tuple[str, str]:
    """Writer A pushes the manifest twice; writer B, which still believes the store is at
    A's first revision, pushes its own manifest on that base and is refused (PushConflict
    naming the manifest) instead of overwriting A's newer one. A's two revisions."""
    write_file(pod_a, MANIFEST, b"manifest from A, first")
    rev0 = a.push([MANIFEST], "A first")
    write_file(pod_a, MANIFEST, b"manifest from A, second")
    rev1 = a.push([MANIFEST], "A second")
    write_file(pod_b, MANIFEST, b"manifest from B")
    with pytest.raises(PushConflict, match=MANIFEST):
        b.push([MANIFEST], "B", base=rev0)
    assert a.head() == rev1
    return rev0, rev1
