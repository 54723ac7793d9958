"""Checkpoint store: the Hugging Face Hub (`hf://owner/repo`) as source of truth, or an
embedded store on disk (`file://hub`): one interface (store.py), the backend chosen by the
pod config's `hub:` URL. Only bytes matching their recorded sha256 are ever installed, and
importing the package imports no HTTP client.

    store = open_store(cfg.hub, pod_dir)
    rev = store.push(["checkpoints/fractus_1b_gpu0.pt", ...,   # ONE revision; or
                      "checkpoints/RESUME_MANIFEST_8GPU.json"], message="sync 12:00")
    store.push({"checkpoints/x.pt": Path("/snap/x.pt")}, msg)   # files staged elsewhere
    store.pull(revision=r)                       # every tracked file, verified, into pod_dir
    store.pull(["checkpoints/fractus_1b_gpu3.pt"], revision=manifest_rev)
    store.history()                              # HistoryEntry, newest first
    store.files(rev)                             # {path: FileEntry(sha256, size)}
    store.stored_objects()                       # {sha256: size} (retention.py)
    store.delete_objects([sha, ...])             # for good

CLI wiring: catch HubError (and ValueError for bad paths/URLs) and print `str(exc)`: it is one
line, never contains the token, and exit 2 for user mistakes. PushConflict means another
writer changed the same paths: stop and report, do not force. IntegrityError means bytes did
not match their recorded sha256: they were not installed. The merge of GPU checkpoints:
`launcher.hub.merge.merge_checkpoints`.

`status`, which only reads files, takes the submodules (sync_state, hub_rate,
retention_ledger, ...) without paying for httpx and huggingface_hub: the names below load
their module at first use.
"""

import importlib

_HOMES = {
    "INDEX_PATH": "integrity", "HubError": "integrity", "IntegrityError": "integrity",
    "PushConflict": "integrity", "RetryPolicy": "retry", "open_store": "by_url",
    "HistoryEntry": "store", "Store": "store",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "INDEX_PATH",
    "HistoryEntry",
    "HubError",
    "IntegrityError",
    "PushConflict",
    "RetryPolicy",
    "Store",
    "open_store",
]
