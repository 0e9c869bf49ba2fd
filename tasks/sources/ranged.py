"""Parts of a stored object without reading it whole: a byte range, or a seekable file object
that reads ranges as it is read (tar headers, Parquet footers and row groups).

These work through the two storages of `tasks/sources/storage.py` (a ranged GET on S3, a seek
on a local file), so tar shards and Parquet files are streamed from where they are, never
copied to disk.
"""

from __future__ import annotations

import io
from typing import BinaryIO

from tasks.sources.storage import LocalStorage, S3Storage, ShortBodyError, Storage

READ_AHEAD = 8 << 20  # a ranged GET fetches at least this much: tar headers of small members share one


def read_range(storage: Storage, key: str, start: int, length: int) -> bytes:
    """`length` bytes of `key` from `start`; fewer only where the object ends first."""
    if length <= 0:
        return b""
    if isinstance(storage, LocalStorage):
        with open(storage.root / key, "rb") as handle:
            handle.seek(start)
            return handle.read(length)
    if isinstance(storage, S3Storage):
        return _s3_range(storage, key, start, length)
    data = storage.read(key)  # any other Storage: whole, then sliced
    return data[start:start + length]


def _s3_range(storage: S3Storage, key: str, start: int, length: int) -> bytes:
    from botocore.exceptions import ClientError, IncompleteReadError, ResponseStreamingError

    client = storage._client  # the storage's own client: its credentials, endpoint and retries
    problem = ""
    for _ in range(3):
        try:
            response = client.get_object(Bucket=storage.bucket, Key=storage.prefix + key,
                                         Range=f"bytes={start}-{start + length - 1}")
        except client.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(f"{storage.describe(key)}: no such object") from exc
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""  # the range starts past the end of the object
            raise
        try:
            body = response["Body"].read()
        except (IncompleteReadError, ResponseStreamingError) as exc:
            problem = f"the body broke off: {exc}"
            continue
        expected = response.get("ContentLength")
        if expected is None or len(body) == expected:
            return body
        problem = f"got {len(body)} of {expected} bytes"
    raise ShortBodyError(f"{storage.describe(key)} bytes {start}+{length}: {problem}")


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over one stored object of known size; each read past the
    buffer is one ranged read of at least READ_AHEAD bytes."""

    def __init__(self, storage: Storage, key: str, size: int, read_ahead: int = READ_AHEAD):
        super().__init__()
        self.storage, self.key, self.size, self.read_ahead = storage, key, size, read_ahead
        self.position = 0
        self._buffer, self._buffer_start = b"", 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.size - self.position
        n = max(0, min(n, self.size - self.position))
        if n == 0:
            return b""
        start, end = self.position, self.position + n
        buffered_end = self._buffer_start + len(self._buffer)
        if not (self._buffer_start <= start and end <= buffered_end):
            length = max(n, self.read_ahead)
            self._buffer, self._buffer_start = read_range(self.storage, self.key, start, length), start
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
        return open(storage.root / key, "rb")
    return RangeFile(storage, key, size)  # type: ignore[return-value]
