"""`data:` of the pod config: where the token shards come from when they are not on disk
(docs/LAUNCHER.md, Shards on the hub). The revision pins the bytes (the store's index at that
commit records each shard's sha256 and size). Parsed offline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launcher.errors import UserError, optional_section

# hf:// names a repo (datasets/ for a dataset repo); the file store's revisions are sha256s
# of their commit records (launcher/hub/local.py), the Hub's are git's sha1s.
_HF_URL = re.compile(r"^hf://(?:(?:datasets|models)/)?[A-Za-z0-9][\w.-]*/[\w.-]+$")
_REVISION_LENGTH = {"hf://": 40, "file://": 64}
_HEX = re.compile(r"^[0-9a-f]+$")


@dataclass(frozen=True)
class DataSource:
    url: str
    revision: str

    KEYS = ("url", "revision")

    @classmethod
    def parse(cls, data: dict | None, source: str = "data") -> "DataSource | None":
        """None when the config names no data source (the shards are the user's to place)."""
        data = optional_section(data, cls.KEYS, source, "{url: ..., revision: ...}")
        if data is None:
            return None
        url, revision = data.get("url"), data.get("revision")
        fix_url = "e.g. hf://datasets/OWNER/REPO or file:///abs/path/to/store"
        if not isinstance(url, str):
            raise UserError(f"{source}.url must be a string ({fix_url}), got {url!r}")
        if url.startswith("hf://") and not _HF_URL.match(url) or \
                url.startswith("file://") and len(url) == len("file://") or \
                not url.startswith(("hf://", "file://")):
            raise UserError(f"{source}.url {url!r} is not a data store URL; write it like "
                            f"{fix_url}")
        length = _REVISION_LENGTH["hf://" if url.startswith("hf://") else "file://"]
        if not isinstance(revision, str) or len(revision) != length or \
                not _HEX.match(revision):
            raise UserError(f"{source}.revision must be the full {length}-hex commit id of "
                            f"{url} that records the shards, got {revision!r}; `fractus-pod "
                            f"data push --to {url}` writes it")
        return cls(url, revision)

    def to_dict(self) -> dict:
        return {"url": self.url, "revision": self.revision}
