"""the pod directory's files: manifest, checkpoint index, events, lock, live state;
and its setup: `init` (setup_init.py) and `adopt` (setup_adopt.py)."""
