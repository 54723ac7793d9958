"""launcher/files.py: the one sha256 implementation (a stream, a file's FileEntry, a file's
hex digest) agree with hashlib and with each other."""

import hashlib
import io

from launcher.files import CHUNK, FileEntry, file_entry, sha256_file, sha256_stream


def test_one_hash_three_views(tmp_path):
    data = bytes(range(256)) * (CHUNK // 256) + b"tail"     # more than one chunk
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    expected = FileEntry(hashlib.sha256(data).hexdigest(), len(data))
    read = []
    assert file_entry(path, read.append) == expected and sum(read) == len(data) and len(read) == 2
    assert sha256_file(path) == expected.sha256
    sink = io.BytesIO()
    assert sha256_stream(io.BytesIO(data), sink) == expected and sink.getvalue() == data
