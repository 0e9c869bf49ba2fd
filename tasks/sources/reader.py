"""What every source format is to the rest of the pipeline: one `SourceReader` per format
(`tasks/sources/registry.py`): `check()` (pre-flight), `items()` (the streamed listing) and
`read(item, member)` (a member's bytes). docs/sources.md, "One interface: readers". Here too the
default format, `FilesReader`: a folder or bucket prefix of media objects.
"""

from __future__ import annotations

import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar
from urllib.parse import urlparse

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.settings import get_settings
from vlm_caption.tasks.sources.formats import SourceSpec, expand_braces, expansion_count, split_location
from vlm_caption.tasks.sources.items import BadInput, ObjectRef, RefusedRef, WorkItem
from vlm_caption.tasks.sources.storage import Storage, StorageError, shared_s3_storage

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
VIDEO_EXTENSIONS = ("mp4", "webm", "mov", "mkv", "avi")
FIRST_PAGE = 1000  # objects the checks read: what the source holds, and its format for `auto` (one S3 page)
ROOT_GROUP = "."  # a group's name for the objects at the source root, beside the folders


class TooLargeError(ValueError):
    """An object is over the configured byte limit; it is not read into memory."""


def _http_get(url: str, max_bytes: int) -> bytes:
    import httpx

    with httpx.stream("GET", url, follow_redirects=True, timeout=30.0) as response:
        response.raise_for_status()
        declared = int(response.headers.get("content-length") or 0)
        if declared > max_bytes:
            raise TooLargeError(f"{url}: {declared} bytes, over the limit of {max_bytes}")
        chunks, total = [], 0
        for chunk in response.iter_bytes():
            total += len(chunk)
            if total > max_bytes:
                raise TooLargeError(f"{url}: over the limit of {max_bytes} bytes")
            chunks.append(chunk)
    return b"".join(chunks)  # a body cut short of its Content-Length: httpx raises RemoteProtocolError


BAD_INPUT = "bad_input"  # the error kind of a `BadInput` (tasks/sources/items.py: storage raises it too)


class SourceReader(ABC):
    """One source format; its class attributes say what a job may ask of it and how `auto` finds it."""

    name: ClassVar[str]
    about: ClassVar[str] = ""  # what the source holds, for `--source-format`'s help
    suffixes: ClassVar[tuple[str, ...]] = ()  # a location whose name ends so is this format (`auto`)
    groups: ClassVar[bool] = False  # items may be groups of images, one per folder (multi-image)
    timed: ClassVar[bool] = False  # listed objects carry their modification time (--modified-since)
    takes_column: ClassVar[bool] = False  # reads --column
    selectable: ClassVar[bool] = True  # named by --source-format (a manifest by --manifest instead)
    checking: ClassVar[str] = "listing the source"  # what the pre-flight is doing, in its messages
    keys_only: ClassVar[bool] = False  # members are keys listed under the source, never locations

    def __init__(self, spec: SourceSpec):
        self.spec = spec

    @property
    def storage(self) -> Storage:
        return self.spec.storage

    @classmethod
    def named_by(cls, location: str) -> bool:
        return bool(cls.suffixes) and location.rstrip("/").endswith(cls.suffixes)

    @classmethod
    def detects(cls, names: list[str]) -> bool:
        """Whether the object names of a prefix's first page are this format's (`auto`)."""
        return False

    @classmethod
    def spec_for(cls, location: str, *, modality: str = "image", glob: str | None = None,
                 column: str | None = None) -> SourceSpec:
        return SourceSpec(location, modality, format=cls.name, glob=glob)

    @classmethod
    def results_location(cls, location: str, spec: SourceSpec | None) -> str:
        """The location the run's fingerprint names: runs over the same one share results."""
        return location

    @abstractmethod
    def check(self) -> SourceSpec:
        """Pre-flight: the source is there and readable; the spec, resolved."""

    @abstractmethod
    def items(self) -> Iterator[WorkItem]:
        """Every work item, in listing order, streamed."""

    def read(self, item: WorkItem, member: ObjectRef) -> bytes:
        """A member's bytes; the item's own problem raised as `BadInput`."""
        if item.problem is not None:
            raise BadInput(item.problem)
        return self.read_member(member)

    def read_member(self, member: ObjectRef) -> bytes:
        """A member's bytes, fetched where it lives: a key under the source, an s3:// URI, an
        http(s) URL or a local path. With `keys_only` (a listing's objects) every key is one under
        the source: a key `in//etc/passwd` or `in/s3://other/x` is that object, never elsewhere."""
        key = member.key
        if self.keys_only:
            return self.storage.read(key)
        scheme = urlparse(key).scheme
        if scheme in ("http", "https"):
            return _http_get(key, get_settings().max_object_bytes)
        if scheme in ("s3", "s3a"):
            bucket, _, path = key.split("://", 1)[1].partition("/")
            return shared_s3_storage(bucket, "").read(path)
        if scheme == "file":
            return Path(urlparse(key).path).read_bytes()
        if os.path.isabs(key):
            return Path(key).read_bytes()
        return self.storage.read(key)

    def locate(self, record_key: str, key: str, size: int, etag: str) -> ObjectRef | None:
        """The member a result record names, located again to read it (the gallery); None if it cannot be."""
        return ObjectRef(key, size, etag)


class ShardFilesReader(SourceReader):
    """A format stored as shard files of its suffix (tars, Parquet): one, a folder or prefix of
    them, or a brace pattern (`shards/{00000..00099}.tar`)."""

    @classmethod
    def spec_for(cls, location: str, *, modality: str = "image", glob: str | None = None,
                 column: str | None = None) -> SourceSpec:
        base, pattern = split_location(location)
        return SourceSpec(base, modality, glob=glob, format=cls.name, pattern=pattern,
                          column=column if cls.takes_column else None)

    def shard_files(self, log=None) -> Iterator[ObjectRef]:
        """The shard files, in listing order: the one named, the brace pattern's, or every one under the source."""
        pattern, suffix = self.spec.pattern, self.suffixes[0]
        if pattern is None:
            yield from (ref for ref in self.storage.iter_objects(self.spec.glob) if ref.key.endswith(suffix))
            return
        expansion_count(pattern)  # a broken or huge pattern: BraceError, saying why
        folder = pattern.split("{", 1)[0].rpartition("/")[0]  # the listing need only look under it
        wanted = set(expand_braces(pattern))
        found: set[str] = set()
        for ref in self.storage.iter_objects(self.spec.glob, prefix=f"{folder}/" if folder else ""):
            if ref.key in wanted:
                found.add(ref.key)
                yield ref
        if len(found) < len(wanted) and log is not None:  # img2dataset leaves gaps where a shard failed
            log.warning("shards named by the pattern are missing", pattern=pattern, found=len(found),
                        expected=len(wanted), examples=sorted(wanted - found)[:3])

    def items(self) -> Iterator[WorkItem]:
        for file in self.shard_files(get_logger(source=self.spec.where)):
            yield from self.file_items(file)

    @abstractmethod
    def file_items(self, file: ObjectRef) -> Iterator[WorkItem]:
        """One shard file's items, in order; what is wrong with the file, an item with a `problem`."""


def _kind(key: str) -> str | None:
    """"image" or "video" by a key's extension; None for anything else (text, metadata)."""
    ext = key.rsplit(".", 1)[-1].lower() if "." in key.rsplit("/", 1)[-1] else ""
    return "image" if ext in IMAGE_EXTENSIONS else "video" if ext in VIDEO_EXTENSIONS else None


class FilesReader(SourceReader):
    """The objects under the source, listed page by page (the default format)."""

    name = "files"
    about = "media objects (one item per object, or per folder with multi-image)"
    groups = True
    timed = True
    keys_only = True  # listed keys, never locations

    def check(self):
        """One page proves access, and tells a small source of images asked for videos (or the other
        way round); a larger one is not judged on it (thumbnails may sort before their videos)."""
        page = list(itertools.islice(self.storage.iter_objects(self.spec.glob), FIRST_PAGE))
        kinds = {_kind(ref.key) for ref in page} - {None}
        wanted = "video" if self.spec.modality == "video" else "image"
        if len(page) < FIRST_PAGE and kinds and wanted not in kinds:
            found = next(ref.key for ref in page if _kind(ref.key))
            raise StorageError(
                f"{self.spec.where}: holds {kinds.pop()}s ({found}, ...), not {wanted}s: use --modality "
                f"{'video' if wanted == 'image' else 'image'}, or a source of {wanted}s")
        return self.spec

    def objects(self) -> Iterator[ObjectRef]:
        return self.storage.iter_objects(self.spec.glob)

    def items(self) -> Iterator[WorkItem]:
        """One item per object, or for multi-image per folder: the whole listing grouped first, a
        folder's objects not being contiguous (S3 sorts `a/b/x.jpg` between `a/a.jpg` and `a/c.jpg`)."""
        if self.spec.modality != "multi-image":
            for ref in self.objects():
                yield WorkItem(ref.key, (ref,), problem=ref.problem if isinstance(ref, RefusedRef) else None)
            return
        groups: dict[str, list[ObjectRef]] = {}
        for ref in self.objects():
            groups.setdefault(ref.key.rsplit("/", 1)[0] if "/" in ref.key else ROOT_GROUP, []).append(ref)
        for folder, members in sorted(groups.items()):  # a group with a refused link is refused whole
            yield WorkItem(folder, tuple(sorted(members, key=lambda m: m.key)),
                           problem=next((m.problem for m in members if isinstance(m, RefusedRef)), None))
