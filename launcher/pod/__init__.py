"""the pod directory's files: manifest, checkpoint index, events, lock, live state."""
