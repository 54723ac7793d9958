"""Checkpoint store: the Hugging Face Hub (`hf://owner/repo`) as source of truth, or an
embedded store on disk (`file://hub`), behind one interface (store.py) chosen by the `hub:`
URL. Only bytes matching their recorded sha256 are ever installed.

CLI wiring: catch HubError (and ValueError for bad paths/URLs) and print `str(exc)`: one
line, never the token. PushConflict: another writer changed the same paths (report, never
force). IntegrityError: bytes did not match; nothing was installed.

Importing the package imports no HTTP client: `status` reads sync_state, hub_rate, ... without
paying for httpx and huggingface_hub; the names below load their module at first use."""

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
