"""Checkpoints that do not stop training: snapshot at the step boundary, write in the background.

Invariants: the `checkpoint` event (`on_durable`) never names a file not yet on disk; at
most one save in flight (host memory: one snapshot); a background failure is raised on the
training thread by the next `check`, `submit` or `wait`; the file is byte for byte what a
synchronous save writes (storages copied, so tied weights stay shared). How and what it
costs: docs/WORKER.md, "Background writes".
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy
import torch

from fractus.train.checkpoint import SavedCheckpoint, save_checkpoint


PAGE_IN_BYTES = 64 << 20


class HostSnapshot:
    """Host copies of a nested payload's tensors, in buffers kept from take to take, keyed
    by position (("model_state", "blocks.0.w")), not storage address: the carried state is a
    new tensor each step, and an address key would allocate a buffer per save."""

    def __init__(self, device: torch.device):
        self.pin = device.type == "cuda"
        self._buffers: dict[tuple, torch.Tensor] = {}   # position -> uint8 host buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def take(self, payload):
        """`payload` with tensors in the host buffers; on CUDA call `ready()` before reading."""
        copied: dict[tuple, torch.Tensor] = {}   # (device, storage address) -> its host buffer
        used: set[tuple] = set()                 # positions whose buffer this take filled
        result = self._copy(payload, (), copied, used)
        for stale in set(self._buffers) - used:   # a tensor that is gone: free its buffer
            del self._buffers[stale]
        self._done = None
        if self.pin:
            self._done = torch.cuda.Event()
            self._done.record()
        return result

    def reserve(self, payload) -> None:
        """Allocate and page in `take(payload)`'s buffers, reading no tensor (safe off the
        training thread): the first save then stalls only for its copy."""
        self._copy(payload, (), {}, set(), copy_data=False)

    def ready(self) -> None:
        """Block until the copies queued by the last `take` have landed (CUDA only)."""
        if self._done is not None:
            self._done.synchronize()

    def _copy(self, value, position: tuple, copied: dict, used: set, copy_data: bool = True):
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, position, copied, used, copy_data)
        if isinstance(value, dict):
            # copy.copy keeps the mapping's type and attributes (a state_dict's _metadata),
            # so the pickled layout is the live one's
            out = copy.copy(value)
            for key in out:
                out[key] = self._copy(value[key], position + (key,), copied, used, copy_data)
            return out
        if isinstance(value, list):
            return [self._copy(v, position + (i,), copied, used, copy_data)
                    for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(v, position + (i,), copied, used, copy_data)
                         for i, v in enumerate(value))
        return value   # numbers, strings, None: immutable, shared as they are

    def _copy_tensor(self, tensor: torch.Tensor, position: tuple, copied: dict, used: set,
                     copy_data: bool) -> torch.Tensor:
        storage = tensor.untyped_storage()
        identity = (str(storage.device), storage.data_ptr())
        host = copied.get(identity)
        if host is None:
            host = self._buffer(position, storage.nbytes())
            used.add(position)
            if not copy_data:   # page the buffer in now, not during a save; in pieces, so
                flat = host.numpy()   # the training thread gets the GIL between them
                for start in range(0, flat.size, PAGE_IN_BYTES):
                    flat[start:start + PAGE_IN_BYTES] = 0
            elif storage.device.type == "cpu":
                # numpy's single-threaded memcpy: torch's parallel copy stalls on the OpenMP
                # barrier when the cores are busy (20x slower measured on the shared box)
                numpy.copyto(host.numpy(), _bytes_of(storage).numpy())
            else:   # queued on the training stream; the writer waits for it (ready())
                host.copy_(_bytes_of(storage), non_blocking=True)
            copied[identity] = host   # bytes: bitwise, whatever the dtype
        view = torch.empty(0, dtype=tensor.dtype)
        return view.set_(host.untyped_storage(), tensor.storage_offset(), tensor.size(),
                         tensor.stride())

    def _buffer(self, position: tuple, nbytes: int) -> torch.Tensor:
        buffer = self._buffers.get(position)
        if buffer is None or buffer.numel() != nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self._buffers[position] = buffer
        return buffer


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage`'s bytes (on its device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass(frozen=True)
class SaveTiming:
    stall_s: float      # the training thread's share: waiting for the previous save + snapshot
    seconds: float      # from the step boundary until the file was durable


class AsyncCheckpointer:
    """One background checkpoint write at a time, from a host snapshot of the payload."""

    def __init__(self, path: str | Path, keep: int, device: torch.device,
                 on_durable: Callable[[SavedCheckpoint, object, SaveTiming], None],
                 on_write: Callable[[object], Callable[[int], None] | None] = lambda tag: None):
        self.path, self.keep = Path(path), keep
        self.snapshot = HostSnapshot(device)
        self._on_durable = on_durable
        self._on_write = on_write            # per save: a hook on the temp file's bytes (tests)
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def prepare(self, payload: dict) -> None:
        """Reserve the buffers in the background; the first `submit` waits for it."""
        self.wait()
        self._thread = threading.Thread(target=self._reserve, args=(payload,),
                                        name="checkpoint-buffers", daemon=True)
        self._thread.start()

    def _reserve(self, payload: dict) -> None:
        try:
            self.snapshot.reserve(payload)
        except BaseException as e:  # e.g. no memory for the buffers: the training thread decides
            self._failure = e

    def submit(self, payload: dict, tag: object = None) -> float:
        """Snapshot now, write in the background; returns the stall (s); `tag` -> on_durable."""
        t0 = time.perf_counter()
        self.wait()                              # one save in flight, one snapshot in memory
        copied = self.snapshot.take(payload)
        stall = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._write, args=(copied, tag, t0, stall),
                                        name="checkpoint-writer", daemon=True)
        self._thread.start()
        return stall

    def _write(self, copied: dict, tag: object, t0: float, stall: float) -> None:
        try:
            self.snapshot.ready()
            saved = save_checkpoint(copied, self.path, keep=self.keep,
                                    on_write=self._on_write(tag))
            self._on_durable(saved, tag, SaveTiming(stall, time.perf_counter() - t0))
        except BaseException as e:  # handed to the training thread, which decides the exit
            self._failure = e

    def check(self) -> None:
        """Raise, on the training thread, the failure of a background write that has ended."""
        if self._thread is not None and not self._thread.is_alive():
            self._join()

    def wait(self) -> None:
        """Block until the save in flight is durable (or raise its failure)."""
        if self._thread is not None:
            self._join()

    def _join(self) -> None:
        # Joined in short slices: a signal handler (a second SIGTERM exits at once) runs
        # between them even where a plain join would not return to the interpreter.
        while self._thread.is_alive():
            self._thread.join(0.1)
        self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
