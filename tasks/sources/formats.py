"""Which kind of source a job reads, and where its files are.

`files` is a folder or prefix of media objects (the default). `webdataset` is tar shards: one
tar, a prefix of tars, or a brace pattern (`shards/{00000..00099}.tar`). `parquet` is a Parquet
file or prefix with a column of media. `auto` picks from the location (`.tar`, `.parquet`,
braces) or, for a prefix, from the objects on the first page of its listing.

`source_storage` is the one place a source's location is opened: a `SourceSpec`'s and a
`FileSet`'s `storage`, and the format's detection, go through it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tasks.sources.braces import check_pattern, expand_braces, has_braces, literal_prefix
from tasks.sources.items import ObjectRef
from tasks.sources.storage import Storage, StorageError, open_storage, split_parent
from tasks.sources.transient import retry_transient

if TYPE_CHECKING:
    from tasks.sources.watermark import ChangedSince

SourceFormat = Literal["auto", "files", "webdataset", "parquet", "inventory"]
SUFFIX = {"webdataset": ".tar", "parquet": ".parquet", "inventory": "manifest.json"}  # tasks/sources/inventory.py
DETECT_PAGE = 1000  # objects looked at to tell a prefix of tars or Parquet files from media


def source_storage(uri: str) -> Storage:
    """The storage of a source's folder or bucket prefix (one per S3 location per process,
    `tasks/sources/storage.py`)."""
    return open_storage(uri)


@dataclass(frozen=True)
class FileSet:
    """The shard files of a source: `pattern` (a file name or brace pattern) under `base`, or
    every file with the format's suffix under `base` when `pattern` is None."""

    base: str
    pattern: str | None
    suffix: str

    @property
    def storage(self) -> Storage:
        """Where the files are (`base`)."""
        return source_storage(self.base)


def split_location(uri: str) -> tuple[str, str | None]:
    """`s3://b/shards/{000..009}.tar` -> (`s3://b/shards/`, `{000..009}.tar`); a single file
    likewise; a folder or prefix -> (itself, None)."""
    path = uri.rstrip("/")
    head = path.split("{", 1)[0]
    if has_braces(uri) or path.endswith((".tar", ".parquet")):
        scheme, _, rest = head.partition("://") if "://" in head else ("", "", head)
        if "/" not in rest:
            raise StorageError(f"{uri}: expected the shards inside a bucket or folder")
        cut = len(head) - len(rest) + rest.rfind("/") + 1
        return path[:cut], path[cut:]
    return uri, None


def format_of_location(uri: str) -> str | None:
    """The format a location names by itself (`.tar`, `.parquet`), or None."""
    name = uri.rstrip("/")
    for fmt, suffix in SUFFIX.items():
        if name.endswith(suffix):
            return fmt
    return None


def detect_format(uri: str, requested: str, is_manifest: bool) -> str:
    """`requested` unless it is `auto`: then from the location, or from the first listed page. A
    page that cannot be listed raises (a guess of `files` would caption a prefix of tars as
    images, and those errors are final); pre-flight says what is wrong with the location."""
    if requested != "auto":
        return requested
    if is_manifest:
        return "files"
    named = format_of_location(uri)
    if named or has_braces(uri):
        return named or "webdataset"
    names = retry_transient(lambda: [ref.key for ref in itertools.islice(source_storage(uri).iter_objects(),
                                                                        DETECT_PAGE)], f"{uri}: first page")
    if any(name.endswith(".tar") for name in names):
        return "webdataset"  # (img2dataset writes .parquet and .json beside its tars)
    if names and all(name.endswith(".parquet") for name in names):
        return "parquet"
    return "files"


def file_set(uri: str, fmt: str) -> FileSet:
    base, pattern = split_location(uri)
    if pattern is not None and has_braces(pattern):
        check_pattern(pattern)
    return FileSet(base, pattern, SUFFIX[fmt])


def iter_files(files: FileSet, glob: str | None = None, log=None) -> Iterator[ObjectRef]:
    """The shard files, in listing order, each with its size and etag."""
    storage = files.storage
    if files.pattern is None:
        yield from (ref for ref in storage.iter_objects(glob) if ref.key.endswith(files.suffix))
        return
    folder = literal_prefix(files.pattern).rpartition("/")[0]
    wanted = set(expand_braces(files.pattern))
    found: set[str] = set()
    for ref in storage.iter_objects(glob, prefix=f"{folder}/" if folder else ""):
        if ref.key in wanted:
            found.add(ref.key)
            yield ref
    if len(found) < len(wanted) and log is not None:  # img2dataset leaves gaps where a shard failed
        log.warning("shards named by the pattern are missing", pattern=files.pattern, found=len(found),
                    expected=len(wanted), examples=sorted(wanted - found)[:3])


def first_file(files: FileSet) -> ObjectRef | None:
    return next(iter_files(files), None)


@dataclass(frozen=True)
class SourceSpec:
    """Where the items come from and how they are formed."""

    uri: str  # a folder or bucket prefix, or a manifest file; for tars and Parquet, their folder
    modality: str = "image"
    is_manifest: bool = False
    glob: str | None = None
    format: str = "files"  # or webdataset | parquet (tasks/sources/formats.py)
    pattern: str | None = None  # tars or Parquet files under `uri`: one name or a brace pattern
    column: str | None = None  # parquet: the media column
    items_root: str | None = None  # inventory: the bucket its report lists (`uri` is the report's manifest.json)
    changed: ChangedSince | None = None  # --modified-since (tasks/sources/watermark.py)

    @property
    def files(self) -> FileSet:
        return FileSet(self.uri, self.pattern, SUFFIX[self.format])

    @property
    def base(self) -> str:
        """The folder or prefix the items' relative keys are under: a manifest's own folder, an
        inventory report's bucket."""
        if self.items_root is not None:
            return self.items_root
        return split_parent(self.uri)[0] if self.is_manifest else self.uri

    @property
    def manifest_name(self) -> str:
        """A manifest's file name within `base`."""
        return split_parent(self.uri)[1]

    @property
    def storage(self) -> Storage:
        """The source's storage (at `base`): listed, and read for the items' media."""
        return source_storage(self.base)
