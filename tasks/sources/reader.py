"""What every source format is to the rest of the pipeline: one `SourceReader` class per format
(`tasks/sources/registry.py` names them), in the spirit of datatrove's readers.

A reader is built from a resolved `SourceSpec` (whose storage the plan opened) and does three
things:

- `check()`: the pre-flight. Lists one page (or finds the file), resolves what the job left open
  (a Parquet column, an inventory's newest report) and returns the spec resolved; a problem is a
  `StorageError` that says what to change.
- `items()`: the streamed listing into work items, never loading media bytes. Each item's members
  carry their size and etag (and last-modified time where the store gives one): what the listing
  judges done items by, and what a content-identity hook (duplicates) may key on.
- `read(item, member)`: a member's bytes. Damage the listing found (`WorkItem.problem`: a tar cut
  short, a row without media) or the read finds is the reader's item error, `BadInput`, recorded
  as a final `bad_input` error; a store's failure is raised as it is (recorded retryable).

A new format is one module with its reader and one entry in the registry.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar

from vlm_caption.tasks.observability import get_logger
from vlm_caption.tasks.sources.braces import check_pattern, expand_braces, literal_prefix
from vlm_caption.tasks.sources.fetch import MediaFetcher
from vlm_caption.tasks.sources.formats import SourceSpec, split_location
from vlm_caption.tasks.sources.items import BadInput, ObjectRef, WorkItem
from vlm_caption.tasks.sources.storage import Storage

BAD_INPUT = "bad_input"  # the error kind of a `BadInput` (tasks/sources/items.py: storage raises it too)


class SourceReader(ABC):
    """One source format. Class attributes say what the job may ask of it (checked when the job
    is made, `flows/params.py`) and how `auto` recognises it."""

    name: ClassVar[str]
    about: ClassVar[str] = ""  # what the source holds, for `--source-format`'s help
    # A location whose name ends so is this format (`--source-format auto`).
    suffixes: ClassVar[tuple[str, ...]] = ()
    # Items may be groups of images, one per folder (`--modality multi-image`).
    groups: ClassVar[bool] = False
    # Listed objects carry their modification time (`--modified-since`).
    timed: ClassVar[bool] = False
    # Reads `--column`.
    takes_column: ClassVar[bool] = False
    # Named by `--source-format` (a manifest is named by `--manifest` instead).
    selectable: ClassVar[bool] = True
    # What the pre-flight is doing, in its error messages.
    checking: ClassVar[str] = "listing the source"
    # Members are keys listed under the source, never locations (`tasks/sources/fetch.py`).
    keys_only: ClassVar[bool] = False

    def __init__(self, spec: SourceSpec):
        self.spec = spec

    @property
    def storage(self) -> Storage:
        """The source's storage, opened once (at the plan) and carried by the spec."""
        return self.spec.storage

    @classmethod
    def named_by(cls, location: str) -> bool:
        """Whether a location names this format by itself (`auto`): its suffix."""
        return bool(cls.suffixes) and location.rstrip("/").endswith(cls.suffixes)

    @classmethod
    def detects(cls, names: list[str]) -> bool:
        """Whether the object names of a prefix's first page are this format's (`auto`)."""
        return False

    @classmethod
    def spec_for(cls, location: str, *, modality: str = "image", glob: str | None = None,
                 column: str | None = None) -> SourceSpec:
        """The spec of a job's location in this format (no storage read)."""
        return SourceSpec(location, modality, format=cls.name, glob=glob)

    @classmethod
    def results_location(cls, location: str, spec: SourceSpec | None) -> str:
        """The location the run's fingerprint names (the job's, resolved; `spec`, its spec if
        made): results are interchangeable between runs over the same one."""
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

    @functools.cached_property
    def fetcher(self) -> MediaFetcher:
        return MediaFetcher(self.storage, keys_only=self.keys_only)

    def read_member(self, member: ObjectRef) -> bytes:
        """A member's bytes (`BadInput` for damage found now; a store's failure as it is): by
        default fetched where it lives, a key under the source or a location."""
        return self.fetcher.read(member)

    def locate(self, record_key: str, key: str, size: int, etag: str) -> ObjectRef | None:
        """The member a result record names (`key`, `size`, `etag`), located again to read it
        (the gallery's pictures); None when it cannot be."""
        return ObjectRef(key, size, etag)


class ShardFilesReader(SourceReader):
    """A format stored as shard files of its suffix (tars, Parquet): one, a folder or prefix of
    them, or a brace pattern (`shards/{00000..00099}.tar`). Its items are each file's in turn."""

    @classmethod
    def spec_for(cls, location: str, *, modality: str = "image", glob: str | None = None,
                 column: str | None = None) -> SourceSpec:
        base, pattern = split_location(location)
        return SourceSpec(base, modality, glob=glob, format=cls.name, pattern=pattern,
                          column=column if cls.takes_column else None)

    def shard_files(self, log=None) -> Iterator[ObjectRef]:
        """The shard files, in listing order, each with its size and etag: the one named, those of
        the brace pattern, or every file with the format's suffix under the source."""
        pattern, suffix = self.spec.pattern, self.suffixes[0]
        if pattern is None:
            yield from (ref for ref in self.storage.iter_objects(self.spec.glob) if ref.key.endswith(suffix))
            return
        check_pattern(pattern)  # a broken or huge pattern: BraceError, saying why
        folder = literal_prefix(pattern).rpartition("/")[0]
        wanted = set(expand_braces(pattern))
        found: set[str] = set()
        for ref in self.storage.iter_objects(self.spec.glob, prefix=f"{folder}/" if folder else ""):
            if ref.key in wanted:
                found.add(ref.key)
                yield ref
        if len(found) < len(wanted) and log is not None:  # img2dataset leaves gaps where a shard failed
            log.warning("shards named by the pattern are missing", pattern=pattern, found=len(found),
                        expected=len(wanted), examples=sorted(wanted - found)[:3])

    def first_file(self) -> ObjectRef | None:
        return next(self.shard_files(), None)

    def items(self) -> Iterator[WorkItem]:
        for file in self.shard_files(get_logger(source=self.spec.where)):
            yield from self.file_items(file)

    @abstractmethod
    def file_items(self, file: ObjectRef) -> Iterator[WorkItem]:
        """One shard file's items, in order; what is wrong with the file, an item with a `problem`."""
