"""Checkpoint store: the Hugging Face Hub as source of truth, or an embedded store on disk.

One interface, two backends chosen by the pod config's `hub:` URL:

    from launcher.hub import open_store, HubError, PushConflict, IntegrityError

    store = open_store(cfg.hub, pod_dir)         # "hf://owner/repo" or "file://hub"

    # sync push: ONE revision holding every file named (pod-relative paths)
    rev = store.push(["checkpoints/fractus_1b_gpu0.pt", ...,
                      "checkpoints/RESUME_MANIFEST_8GPU.json"], message="sync 12:00")
    # or with files staged elsewhere: store.push({"checkpoints/x.pt": Path("/snap/x.pt")}, msg)

    # sync pull / launch --from-hub [--revision R]: verified files land in pod_dir
    paths = store.pull(revision=args.revision)   # every tracked file; or pull([...paths])

    # sync history
    for h in store.history():                    # newest first
        print(h.revision[:12], h.timestamp.isoformat(), h.message)

    # launch, a checkpoint missing or failing its sha256: fetch it from its pinned revision
    store.pull(["checkpoints/fractus_1b_gpu3.pt"], revision=manifest_rev)

    # what a revision holds: {path: FileEntry(sha256, size)} (launcher.files.FileEntry)
    store.files(rev)

    # storage (launcher/hub/retention.py applies the pod's `retention:` after each push)
    store.stored_objects()                        # {sha256: size} of the large objects held
    store.delete_objects([sha, ...])              # for good (hf://: permanently_delete_lfs_files)

CLI wiring: catch HubError (and ValueError for bad paths/URLs) and print `str(exc)`: it is one
line, never contains the token, and exit 2 for user mistakes. PushConflict means another
writer changed the same paths: stop and report, do not force. IntegrityError means bytes did
not match their recorded sha256: they were not installed.

The merge of GPU checkpoints lives in `launcher.hub.merge.merge_checkpoints`.

Importing the package imports no HTTP client: `status`, which only reads files, takes its
submodules (sync_state, hub_rate, retention_ledger, ...) without paying for httpx and
huggingface_hub; the names below load their module at first use.
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
