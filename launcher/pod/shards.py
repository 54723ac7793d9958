"""A token shard as the worker reads it: its length, or why what is there is no shard file.
The length comes from the header, without torch (`status` reads it on every refresh)."""

from __future__ import annotations

import ast
import io
import pickle
import re
import stat
import zipfile
from collections import OrderedDict
from pathlib import Path

from launcher.pod.manifest import ManifestError

NPY_HEADER_MAX = 10_000     # numpy.lib.format's default max_header_size
# The storages of a .pt shard's integer tensor (a float one is refused by the worker).
_INT_STORAGES = {"ByteStorage", "CharStorage", "ShortStorage", "IntStorage", "LongStorage"}


def shard_length(path: Path) -> int:
    """Tokens in a shard; one the worker would refuse (2-D, float, empty) is refused here.
    Read from the header when well-formed, else by the worker's own reader."""
    problem = shard_kind_problem(Path(path))
    if problem is not None:
        raise ManifestError(problem)
    length = header_length(Path(path))
    if length is not None:
        return length
    from fractus.data import ShardError, TokenShard   # torch (~2 s): only for a shard in doubt
    try:
        return len(TokenShard(path))
    except ShardError as exc:
        raise ManifestError(f"{exc}; write the GPU's tokens there as a 1-D integer array "
                            f"(e.g. np.save(path, tokens.astype(np.uint16)))") from None


def header_length(path: Path) -> int | None:
    """The length of a complete 1-D integer .npy or .pt shard from its header, else None."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            return None         # a FIFO is never opened: reading it would block
        if path.suffix == ".npy":
            return _npy_length(path)
        if path.suffix == ".pt":
            return _pt_length(path)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, pickle.UnpicklingError):
        return None
    return None


def _npy_length(path: Path) -> int | None:
    """A .npy file's length from its header, without numpy (its import alone is a fifth of
    a second of `status` on a busy machine)."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:6] != b"\x93NUMPY" or head[6] not in (1, 2, 3):
            return None
        size_len = 2 if head[6] == 1 else 4
        header_len = int.from_bytes(head[8:8 + size_len], "little")
        if header_len > NPY_HEADER_MAX:
            return None             # numpy's own limit: np.load refuses it too
        f.seek(8 + size_len)
        header = f.read(header_len)
    data_at = 8 + size_len + header_len
    if len(header) != header_len:
        return None
    try:
        meta = ast.literal_eval(header.decode("latin1" if head[6] < 3 else "utf8"))
    except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        return None
    if not isinstance(meta, dict):
        return None
    descr, shape = meta.get("descr"), meta.get("shape")
    kind = re.fullmatch(r"[<>|=]?[iu](\d+)", descr) if isinstance(descr, str) else None
    if kind is None or not (isinstance(shape, tuple) and len(shape) == 1
                            and type(shape[0]) is int and shape[0] >= 0):
        return None                 # not a 1-D integer array
    if path.stat().st_size < data_at + shape[0] * int(kind[1]):
        return None                 # cut short: np.load's memory map refuses it
    return shape[0]


class _TensorRecord(pickle.Unpickler):
    """A .pt file's data.pkl read as names only; any other global refuses the file."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, *rest: (storage, offset, size)
        if module == "torch" and name in _INT_STORAGES:
            return name
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return pid               # ('storage', kind, key, location, numel)


def _pt_length(path: Path) -> int | None:
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            return None
        record = _TensorRecord(io.BytesIO(archive.read(names[0]))).load()
    if not (isinstance(record, tuple) and len(record) == 3):
        return None
    storage, offset, size = record
    if not (isinstance(storage, tuple) and len(storage) == 5 and storage[1] in _INT_STORAGES
            and isinstance(size, tuple) and len(size) == 1 and isinstance(size[0], int)
            and isinstance(offset, int) and isinstance(storage[4], int)
            and 0 <= offset and offset + size[0] <= storage[4]):
        return None
    return size[0]


def shard_kind_problem(path: Path) -> str | None:
    """Why `path` is no shard file though something is there (None: a file, or nothing)."""
    if not path.exists() or path.is_file():
        return None
    kind = "a directory" if path.is_dir() else "not a regular file (a FIFO, socket or device)"
    return f"shard {path} is {kind}; put the GPU's token file there"
