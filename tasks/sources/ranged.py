"""A seekable file over a stored object that reads ranges as it is read (`Storage.read_range`):
tar headers, Parquet footers and row groups streamed from where they are, never copied to disk.
"""

from __future__ import annotations

import io
from typing import BinaryIO

from vlm_caption.tasks.sources.storage import LocalStorage, Storage

READ_AHEAD = 8 << 20  # a ranged GET fetches at least this much: tar headers of small members share one


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over an object of known size; each read past the buffer is one
    ranged read of at least `read_ahead` bytes."""

    def __init__(self, storage: Storage, key: str, size: int, read_ahead: int = READ_AHEAD):
        super().__init__()
        self.storage, self.key, self.size, self.read_ahead = storage, key, size, read_ahead
        self.position = 0
        self._buffer, self._buffer_start = b"", 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.position if n is None or n < 0 else min(n, self.size - self.position)
        if n <= 0:
            return b""
        start = self.position
        if not (self._buffer_start <= start and start + n <= self._buffer_start + len(self._buffer)):
            self._buffer, self._buffer_start = self.storage.read_range(self.key, start, max(n, self.read_ahead)), start
        offset = start - self._buffer_start
        data = self._buffer[offset:offset + n]
        self.position += len(data)
        return data

    def readinto(self, target) -> int:
        data = self.read(len(target))
        target[:len(data)] = data
        return len(data)


def open_seekable(storage: Storage, key: str, size: int) -> BinaryIO:
    """A seekable file over the object: the file itself for a folder, ranged reads for S3."""
    if isinstance(storage, LocalStorage):
        return open(storage.path(key), "rb")  # the folder's rules on keys and links (local_paths.py)
    return RangeFile(storage, key, size)  # type: ignore[return-value]
