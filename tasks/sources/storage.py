"""Object storage behind one small interface: S3-compatible buckets and local folders, keys
relative to the root. Listing is lazy (paginated, or a sorted walk; `prefix` may end inside a name,
`start_after` is S3's StartAfter); writes are atomic (one PUT, or temp file + rename); `open_seekable`
streams tar headers, Parquet footers and row groups from where they are, never copied to disk."""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol
from urllib.parse import urlparse

from vlm_caption.tasks.errors import UserError
from vlm_caption.tasks.sources.items import ObjectRef
from vlm_caption.tasks.sources.local_paths import key_path, walk_files
from vlm_caption.tasks.sources.s3_client import ShortBodyError, error_code, shared_s3_client


class StorageError(UserError, ValueError):
    """A storage location cannot be used; the message says how to fix it."""


SHORT_BODY_ATTEMPTS = 5


class Storage(Protocol):
    uri: str

    def iter_objects(self, glob: str | None = None, prefix: str = "", start_after: str = "") -> Iterator[ObjectRef]: ...
    def read(self, key: str) -> bytes: ...
    def read_range(self, key: str, start: int, length: int) -> bytes: ...
    def write(self, key: str, data: bytes) -> None: ...
    def create(self, key: str, data: bytes) -> bool: ...
    def exists(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def describe(self, key: str) -> str: ...


def matches_glob(relative: str, glob: str | None) -> bool:
    return glob is None or fnmatch.fnmatch(relative, glob) or fnmatch.fnmatch(relative.rsplit("/", 1)[-1], glob)


class LocalStorage:
    """A folder: its keys stay below it, links leading out followed only with `follow_links`."""

    def __init__(self, root: str | Path, *, create: bool = False, follow_links: bool = True):
        self.root = Path(root).expanduser().resolve()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise StorageError(f"{root}: no such folder. Give an existing folder or an s3:// URI.")
        self.uri = str(self.root)
        self.follow_links = follow_links

    def iter_objects(self, glob: str | None = None, prefix: str = "", start_after: str = "") -> Iterator[ObjectRef]:
        start = self.root / prefix
        if not start.is_dir():  # a prefix ending inside a name: its folder's names that begin with it
            if not prefix or prefix.endswith("/") or not start.parent.is_dir():
                return
            start = start.parent
        yield from walk_files(self.uri, str(start), prefix, start_after, lambda key: matches_glob(key, glob),
                              self.follow_links)

    def path(self, key: str) -> str:
        """The file `key` names; `RefusedKey` where it leads outside the folder."""
        return key_path(self.uri, key, self.follow_links)

    def read(self, key: str) -> bytes:
        return Path(self.path(key)).read_bytes()

    def read_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        with open(self.path(key), "rb") as handle:
            handle.seek(start)
            return handle.read(length)

    @contextlib.contextmanager
    def _staged(self, key: str, data: bytes) -> Iterator[tuple[str, Path]]:
        """`data` in a temporary file beside `key`'s path (folders made), removed afterwards."""
        path = Path(key_path(self.uri, key))  # never written outside the folder
        for attempt in range(3):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
                break
            except FileNotFoundError:  # a delete took the folder away as it emptied (`delete`)
                if attempt == 2:
                    raise
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            yield tmp, path
        finally:
            Path(tmp).unlink(missing_ok=True)

    def write(self, key: str, data: bytes) -> None:
        with self._staged(key, data) as (tmp, path):
            os.replace(tmp, path)  # atomic: readers see the old file or the new one

    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist (True), atomically: of several writers one gets True."""
        with self._staged(key, data) as (tmp, path):
            try:
                os.link(tmp, path)  # fails if the name exists; the complete file appears at once
                return True
            except FileExistsError:
                return False

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def delete(self, key: str) -> None:
        path = Path(key_path(self.uri, key))
        path.unlink(missing_ok=True)
        if path.parent != self.root:
            with contextlib.suppress(OSError):  # as in a bucket, a folder goes with its last file
                path.parent.rmdir()  # (a fold leaves no empty parquet/<fp>/); one not empty stays

    def describe(self, key: str) -> str:
        return str(self.root / key)


class S3Storage:
    def __init__(self, bucket: str, prefix: str, client=None):
        self.bucket = bucket
        self.prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        self.uri = f"s3://{bucket}/{self.prefix}"
        self._client = client or shared_s3_client()

    def iter_objects(self, glob: str | None = None, prefix: str = "", start_after: str = "") -> Iterator[ObjectRef]:
        paginator = self._client.get_paginator("list_objects_v2")
        after = {"StartAfter": self.prefix + start_after} if start_after else {}
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix, **after):
                for obj in page.get("Contents", []):
                    key = obj["Key"]
                    relative = key[len(self.prefix):]
                    if not relative or key.endswith("/") or not matches_glob(relative, glob):
                        continue
                    yield ObjectRef(relative, int(obj["Size"]), obj.get("ETag", "").strip('"'),
                                    obj["LastModified"].timestamp() if "LastModified" in obj else None)
        except self._client.exceptions.NoSuchBucket as exc:
            raise StorageError(f"{self.uri}: bucket {self.bucket!r} does not exist") from exc

    def read_range(self, key: str, start: int, length: int) -> bytes:
        """`length` bytes from `start`; fewer only where the object ends first. Retried like `read`."""
        if length <= 0:
            return b""
        try:
            return self.read(key, Range=f"bytes={start}-{start + length - 1}")
        except self._client.exceptions.ClientError as exc:
            if error_code(exc) == "InvalidRange":
                return b""  # the range starts past the end of the object
            raise

    def read(self, key: str, **request) -> bytes:
        """The whole object (or a `Range=`: one GET), fetched again while the body breaks off
        (botocore's read checks it against the Content-Length), never passed on as if complete;
        the client's own retries cover the request itself."""
        from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError

        for _ in range(SHORT_BODY_ATTEMPTS):
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key, **request)
            except self._client.exceptions.NoSuchKey as exc:
                raise FileNotFoundError(f"{self.describe(key)}: no such object") from exc
            try:
                return response["Body"].read()
            except (IncompleteReadError, ResponseStreamingError, ReadTimeoutError) as exc:
                problem = exc  # the connection was cut or stalled mid-body
        what = f" ({request['Range']})" if "Range" in request else ""
        raise ShortBodyError(f"{self.describe(key)}{what}: the body broke off: {problem} "
                             f"({SHORT_BODY_ATTEMPTS} attempts)")

    def write(self, key: str, data: bytes) -> None:
        # A single PUT is atomic: readers never see a partial object.
        self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data)

    def create(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist (True): a conditional PUT (`If-None-Match: *`; atomic
        on AWS S3 and MinIO, not on bare moto: bench/loopback_s3.py), so one writer gets True.
        A retry of our own PUT whose first answer was lost finds our bytes there: that is ours too."""
        try:
            self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, IfNoneMatch="*")
            return True
        except self._client.exceptions.ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error_code(exc) not in ("PreconditionFailed", "ConditionalRequestConflict") and status not in (409, 412):
                raise
        try:
            return self.read(key) == data
        except FileNotFoundError:  # deleted since: nobody holds it now, try once more
            return self.create(key, data)

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return True
        except self._client.exceptions.ClientError as exc:
            if error_code(exc) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.bucket, Key=self.prefix + key)

    def describe(self, key: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"


def key_within(storage: Storage, uri: str) -> str:
    """The key of `uri` (as `storage.describe` wrote it) under the storage's root."""
    root = storage.describe("").rstrip("/") + "/"
    if not uri.startswith(root):
        raise StorageError(f"{uri} is not under {root}")
    return uri[len(root):]


_shared_stores: dict[tuple, S3Storage] = {}


def shared_s3_storage(bucket: str, prefix: str) -> S3Storage:
    """One S3Storage per location per process, all on the process's one client (a race makes a
    spare one, dropped: `setdefault` is atomic)."""
    client = shared_s3_client()
    key = (id(client), bucket, prefix)
    return _shared_stores.get(key) or _shared_stores.setdefault(key, S3Storage(bucket, prefix, client=client))


def split_parent(uri: str) -> tuple[str, str]:
    """`s3://b/dir/file.jsonl` -> (`s3://b/dir/`, `file.jsonl`); a local path likewise."""
    uri = uri.rstrip("/")
    if "/" not in uri.split("://", 1)[-1]:
        raise StorageError(f"{uri}: expected a file inside a bucket or folder")
    parent, _, name = uri.rpartition("/")
    return (parent + "/" if "://" in parent or parent else "/"), name


def check_location(uri: str) -> str:
    """`uri` stripped, where it is `s3://bucket/prefix`, `file:///path` or a local path; else what to give."""
    if not (uri := uri.strip()):
        raise StorageError("empty location")
    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "s3a") and not parsed.netloc:
        raise StorageError(f"{uri}: missing bucket name; use s3://BUCKET/PREFIX/")
    if parsed.scheme not in ("s3", "s3a", "file") and len(parsed.scheme) > 1:  # "C:" on Windows is a drive
        raise StorageError(f"{uri}: unsupported scheme {parsed.scheme!r}. Use s3://bucket/prefix "
                           "(AWS S3, MinIO, R2, Ceph via VLM_CAPTION_S3_ENDPOINT_URL) or a local folder.")
    return uri


def open_storage(uri: str, *, create: bool = False, follow_links: bool = True) -> Storage:
    """A Storage for `s3://bucket/prefix`, `file:///path` or a plain local path."""
    parsed = urlparse(uri := check_location(uri))
    if parsed.scheme in ("s3", "s3a"):
        return shared_s3_storage(parsed.netloc, parsed.path.lstrip("/"))
    return LocalStorage(parsed.path if parsed.scheme == "file" else uri, create=create, follow_links=follow_links)


READ_AHEAD = 8 << 20  # a ranged GET fetches at least this much: tar headers of small members share one


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over an object of known size, each read one ranged read (the
    `io.BufferedReader` over it reads ahead)."""

    def __init__(self, storage: Storage, key: str, size: int):
        super().__init__()
        self.storage, self.key, self.size, self.position = storage, key, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, target) -> int:
        data = self.storage.read_range(self.key, self.position, min(len(target), self.size - self.position))
        target[:len(data)] = data
        self.position += len(data)
        return len(data)


def open_seekable(storage: Storage, key: str, size: int) -> BinaryIO:
    """A seekable file over the object: the file itself for a folder, ranged reads for S3."""
    if isinstance(storage, LocalStorage):
        return open(storage.path(key), "rb")  # the folder's rules on keys and links (local_paths.py)
    return io.BufferedReader(RangeFile(storage, key, size), READ_AHEAD)  # type: ignore[return-value]
